"""Caches across real processes: never stale past a position, and the invalidator restarts safely."""

from __future__ import annotations

import json
import random
import secrets
import time
from collections.abc import Awaitable, Callable

from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.caching import CacheTier, open_tier, tier_prefix
from synflow.config import CacheConfig, RedisConfig
from synflow.tokens import StreamToken
from synflow.tools.client import Client, new_pool
from tests import services
from tests.caching.test_tier import wait_connected
from tests.cluster import Cluster, free_port, scrape_metrics, sleep, wait_until

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
    def start(self, server_name: str = "test.local"):
        shared = {}
        if self.tier:
            services.require_redis()
            shared = {"caches": {"tier": {"host": services.REDIS_HOST, "port": services.REDIS_PORT,
                                          "channel_prefix": services.redis_prefix()}}}
        cluster = Cluster(self, engine=self.engine, transport=self.transport, writers=WRITERS,
                          extra_instances=("cache_invalidator1",), shared=shared, server_name=server_name)
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

    async def _interleave(self, cluster: Cluster, rounds: int) -> None:
        a_url = f"http://127.0.0.1:{self.ports['persister1']}"
        b_url = f"http://127.0.0.1:{self.ports['master']}"
        owner = await Client(a_url, self.pool).register("owner")
        room = await owner.create_room(preset="public_chat")  # members leave and join again
        users = [await Client(a_url, self.pool).register(f"m{i}") for i in range(6)]
        reader = owner.at(b_url)
        rng = random.Random(5)
        joined: set[int] = set()
        reads = []
        for _ in range(rounds):
            i = rng.randrange(len(users))
            if i in joined:
                await users[i].leave(room)
                joined.discard(i)
            else:
                await users[i].join(room)
                joined.add(i)
            for _ in range(rng.randrange(1, 4)):
                reads.append(await reader.members(room))
        ids = instance_ids(cluster)
        events = membership_events(cluster, room)
        for read in reads:
            token = StreamToken.parse(read["token"])
            must, must_not = allowed_members(events, token, ids)
            members = set(read["members"])
            self.assertEqual(must - members, set(), f"stale read at {read['token']}: missing {must - members}")
            self.assertEqual(members & must_not, set(), f"stale read at {read['token']}: still has {members & must_not}")

    @inlineCallbacks
    def test_membership_never_stale_past_position(self):
        """Reads on the master at token T reflect every join and leave made through a persister up to T."""
        cluster = yield self.start()
        yield ensureDeferred(self._interleave(cluster, 60))
        metrics = scrape_metrics(self.metrics_port)
        # Every read after the first of one step finds the members cached.
        self.assertGreater(metrics.get('synflow_cache_hits_total{cache="get_users_in_room"}', 0), 0)
        self.assertGreater(metrics.get('synflow_cache_misses_total{cache="get_users_in_room"}', 0), 0)
        self.assertGreater(metrics.get('synflow_cache_hits_total{cache="get_user_by_access_token"}', 0), 0)
        self.assertGreater(metrics.get('synflow_cache_invalidations_total{cache="get_users_in_room"}', 0), 0)


class SqliteCacheTest(CacheMixin, TestCase):
    pass


class PostgresRedisTierCacheTest(CacheMixin, TestCase):
    engine = "postgres"
    transport = "redis"
    tier = True

    @inlineCallbacks
    def test_invalidator_killed_and_restarted(self):
        """A membership change made while the invalidator is down is not lost: after its restart (and no other write) the tier serves nothing older."""
        server_name = f"c{secrets.token_hex(4)}.test"  # a tier prefix of its own
        cluster = yield self.start(server_name)
        config = CacheConfig(tier=RedisConfig(host=services.REDIS_HOST, port=services.REDIS_PORT),
                             cache_invalidator_instances=["cache_invalidator1"])
        tier = open_tier(reactor, config, tier_prefix(server_name))
        assert tier is not None
        self.addCleanup(lambda: ensureDeferred(_drop_keys(tier)))
        yield ensureDeferred(self._kill_and_restart(cluster, tier))

    async def _kill_and_restart(self, cluster: Cluster, tier: CacheTier) -> None:
        await wait_connected(tier)
        floor_key = f"{tier.keys.prefix}:!floor:cache_invalidator1"
        await _wait_for(lambda: _exists(tier, floor_key), 60, "the invalidator's floor")
        owner = await Client(f"http://127.0.0.1:{self.ports['persister1']}", self.pool).register("owner")
        room = await owner.create_room(preset="public_chat")
        users = [await Client(owner.base_url, self.pool).register(f"m{i}") for i in range(3)]
        for user in users:
            await user.join(room)
        members = sorted([owner.user_id, *(u.user_id for u in users)])
        # 1. The master reads the members (at a position past every join) and fills the tier.
        await self._master_caught_up(max(_last_caches_id(cluster), await _floor(tier)))
        reader = owner.at(f"http://127.0.0.1:{self.ports['master']}")
        self.assertEqual(sorted((await reader.members(room))["members"]), members)
        await _wait_for(lambda: _visible(tier, room), 30, "the master's fill of the tier")
        filled = await tier.lookup("get_users_in_room", (room,))
        assert filled is not None
        self.assertEqual(filled[0], members)
        # 2. Kill the invalidator; one last membership change; the master's position passes it.
        cluster.kill("cache_invalidator1")
        await users[0].leave(room)
        final = _last_caches_id(cluster)
        keys = json.loads(cluster.query("SELECT keys FROM cache_invalidations WHERE stream_id = ?", (final,))[0][0])
        self.assertEqual(keys, [room, users[0].user_id])
        await self._master_caught_up(final, writer="persister1")  # the dead invalidator's position is stuck
        stale = await tier.lookup("get_users_in_room", (room,))
        self.assertIsNotNone(stale, "the tier lost the value without an invalidator: the test proves nothing")
        assert stale is not None
        self.assertLess(stale[1], final)
        # 3. Restart the invalidator, with no further write, and read through a fresh master.
        cluster.start_twistd("cache_invalidator1", "cache_invalidator")
        await wait_until(lambda: cluster.healthy("cache_invalidator1"), 60, "the invalidator to restart")
        await _wait_for(lambda: _no_older_value(tier, room, final), 30,
                        "the restarted invalidator to retire the value filled before the change")
        await cluster.stop("master")
        await cluster.start_master(listeners=[
            {"resources": ["client"], "endpoint": f"tcp:{self.ports['master']}:interface=127.0.0.1"},
            {"resources": ["metrics"], "endpoint": f"tcp:{self.metrics_port}:interface=127.0.0.1"},
        ])
        await cluster.wait_for_port(self.ports["master"], "master")
        await self._master_caught_up(max(final, await _floor(tier)))  # so that its fill is not refused
        expected = sorted(set(members) - {users[0].user_id})
        self.assertEqual(sorted((await reader.members(room))["members"]), expected)
        # The fresh master's fill is at or past the change; nothing older is visible.
        await _wait_for(lambda: _visible(tier, room), 30, "the fresh master's fill of the tier")
        entry = await tier.client.hgetall(f"{tier.keys.prefix}:get_users_in_room:{json.dumps([room])}")
        self.assertGreaterEqual(int(entry["p"]), final, entry)
        self.assertEqual(json.loads(entry["v"]), expected)
        self.assertTrue(await _no_older_value(tier, room, final))
        self.assertEqual(len(cluster.query("SELECT 1 FROM cache_invalidations WHERE stream_id > ?", (final,))), 0)

    async def _master_caught_up(self, stream_id: int, writer: str | None = None) -> None:
        """Wait until the master's caches positions (every writer's, or one writer's) reach ``stream_id``."""
        def caught_up() -> bool:
            try:
                metrics = scrape_metrics(self.metrics_port)
            except OSError:
                return False
            positions = [v for k, v in metrics.items()
                         if k.startswith("synflow_replication_stream_position{") and 'stream="caches"' in k
                         and (writer is None or f'instance="{writer}"' in k)]
            return bool(positions) and min(positions) >= stream_id

        await wait_until(caught_up, 60, f"the master's caches positions to reach {stream_id}")


async def _wait_for(predicate: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """Poll an asynchronous predicate until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await sleep(0.1)


async def _floor(tier: CacheTier) -> int:
    return int(await tier.client.get(f"{tier.keys.prefix}:!floor:cache_invalidator1"))


def _last_caches_id(cluster: Cluster) -> int:
    return int(cluster.query("SELECT MAX(stream_id) FROM cache_invalidations")[0][0])


async def _exists(tier: CacheTier, key: str) -> bool:
    return bool(await tier.client.exists(key))


async def _visible(tier: CacheTier, room: str) -> bool:
    return await tier.lookup("get_users_in_room", (room,)) is not None


async def _no_older_value(tier: CacheTier, room: str, stream_id: int) -> bool:
    """No value of the room's members filled below ``stream_id`` is visible in the tier."""
    entry = await tier.lookup("get_users_in_room", (room,))
    return entry is None or entry[1] >= stream_id


async def _drop_keys(tier: CacheTier) -> None:
    keys = await tier.client.keys(f"{tier.keys.prefix}:*")
    if keys:
        await tier.client.delete(*keys)
    await tier.close()
