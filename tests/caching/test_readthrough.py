"""``@cached(tier=True)``: local LRU, then the tier, then the database, then a guarded fill."""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from synflow.caching import CacheRegistry, FakeCacheTier, TierInvalidator, open_tier
from synflow.config import CacheConfig, RedisConfig
from synflow.streams import CachesRow
from tests.caching.stores import TierStore, sample
from tests.caching.test_tier import wait_connected
from tests.services import REDIS_HOST, REDIS_PORT, redis_prefix, require_redis

TTL_S = 60.0
INVALIDATORS = ["inv1"]


class RecordingTier:
    """Wraps a tier and logs each call into a shared event log."""

    def __init__(self, tier: Any, log: list[tuple[Any, ...]]) -> None:
        self.tier = tier
        self.log = log

    def lookup(self, name: str, key: Any) -> Deferred[Any]:
        self.log.append(("tier.lookup", key))
        return self.tier.lookup(name, key)

    def fill(self, name: str, key: Any, value: Any, position: int) -> Deferred[bool]:
        self.log.append(("tier.fill", key, value, position))
        return self.tier.fill(name, key, value, position)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.tier, attr)


class Process:
    """One process's view: its caches-stream position, registry and store."""

    def __init__(self, tier: Any, clock: Clock, log: list[tuple[Any, ...]] | None = None) -> None:
        self.position = 0
        self.log = log if log is not None else []
        self.clock = clock
        self.registry = CacheRegistry(CacheConfig(tier_ttl_s=TTL_S), tier=RecordingTier(tier, self.log),
                                      position_source=self.read_position, clock=clock)
        self.store = TierStore()
        self.registry.register(self.store)

    def read_position(self) -> int:
        self.log.append(("position", self.position))
        return self.position

    def receive(self, stream_id: int, key: str) -> None:
        """This process applies caches-stream row ``stream_id`` invalidating ``key``."""
        self.registry.apply([CachesRow("tier_get_user", (key,), 0)], stream_id)
        self.position = max(self.position, stream_id)


class ReadThroughTest(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.tier = FakeCacheTier(TTL_S, invalidators=INVALIDATORS, clock=self.clock)
        self.tier.raise_floor("inv1", 0)

    def test_order_local_then_tier_then_database(self) -> None:
        """A miss looks in the tier, then reads the position, then the database, then fills at that position."""
        p = Process(self.tier, self.clock)
        p.position = 4
        d = p.store.get_user("@a")
        self.assertEqual(p.log, [("tier.lookup", ("@a",)), ("position", 4)])
        self.assertEqual(len(p.store.gates), 1)  # the database read started after the position
        p.store.answer_with({"n": "A"})
        self.assertEqual(self.successResultOf(d), {"n": "A"})
        self.assertEqual(p.log[-1], ("tier.fill", ("@a",), {"n": "A"}, 4))
        p.log.clear()
        self.assertEqual(self.successResultOf(p.store.get_user("@a")), {"n": "A"})
        self.assertEqual(p.log, [])  # a local hit touches neither tier nor database

    def test_tier_hit_skips_database(self) -> None:
        """A value in the tier is answered, and cached locally, without a database read."""
        writer = Process(self.tier, self.clock)
        self.successResultOf(self.tier.fill("tier_get_user", ("@a",), "A", 2))
        d = writer.store.get_user("@a")
        self.assertEqual(self.successResultOf(d), "A")
        self.assertEqual(writer.store.gates, [])
        self.assertIn(("@a",), writer.store.get_user.cache)

    def test_stale_fill_race_with_a_slow_reader(self) -> None:
        """A slow reader's fill of a value read before an invalidation the invalidator already applied is refused."""
        hits = sample("synflow_cache_tier_fills_total", cache="tier_get_user", result="refused")
        reader, other = Process(self.tier, self.clock), Process(self.tier, self.clock)
        reader.store.db["@bob"] = other.store.db["@bob"] = "Bob"
        reader.position = other.position = 5
        d = reader.store.get_user("@bob")  # reads the position (5), then the database...
        self.assertEqual(len(reader.store.gates), 1)
        value_read = reader.store.db["@bob"]  # ...which still holds the old value
        # A writer changes it and records invalidation 7; the invalidator applies it to the tier.
        reader.store.db["@bob"] = other.store.db["@bob"] = "Robert"
        self.successResultOf(self.tier.invalidate("tier_get_user", ("@bob",), 7))
        other.receive(7, "@bob")
        # The reader's database read now completes; its fill at 5 is refused.
        reader.store.answer_with(value_read)
        self.assertEqual(self.successResultOf(d), "Bob")
        self.assertEqual(reader.log[-1], ("tier.fill", ("@bob",), "Bob", 5))
        self.assertIsNone(self.successResultOf(self.tier.lookup("tier_get_user", ("@bob",))))
        self.assertEqual(sample("synflow_cache_tier_fills_total", cache="tier_get_user", result="refused") - hits, 1)
        # Another process reads the new value from the database and fills it.
        d2 = other.store.get_user("@bob")
        other.store.answer()
        self.assertEqual(self.successResultOf(d2), "Robert")
        self.assertEqual(self.successResultOf(self.tier.get("tier_get_user", ("@bob",))), (True, "Robert"))
        # The slow reader drops its local copy when the invalidation reaches it, then reads through the tier.
        reader.receive(7, "@bob")
        self.assertEqual(self.successResultOf(reader.store.get_user("@bob")), "Robert")

    def test_tier_value_older_than_a_local_invalidation_is_distrusted(self) -> None:
        """A tier value filled before an invalidation this process applied (but the invalidator has not) is not used."""
        p = Process(self.tier, self.clock)
        self.successResultOf(self.tier.fill("tier_get_user", ("@a",), "old", 3))
        p.receive(6, "@a")  # the invalidator lags: the tier still holds "old"
        d = p.store.get_user("@a")
        self.assertEqual(len(p.store.gates), 1)  # went to the database
        p.store.answer_with("new")
        self.assertEqual(self.successResultOf(d), "new")
        self.assertEqual(self.successResultOf(p.store.get_user("@a")), "new")
        # A value filled at or after the invalidation is trusted.
        self.successResultOf(self.tier.fill("tier_get_user", ("@b",), "b", 6))
        p.receive(6, "@b")
        self.assertEqual(self.successResultOf(p.store.get_user("@b")), "b")

    def test_invalidation_during_database_read_skips_fill(self) -> None:
        """A read invalidated while in flight neither fills the tier nor the local cache."""
        p = Process(self.tier, self.clock)
        d = p.store.get_user("@a")
        p.receive(3, "@a")
        p.store.answer_with("old")
        self.assertEqual(self.successResultOf(d), "old")
        self.assertNotIn(("@a",), p.store.get_user.cache)
        self.assertEqual([e[0] for e in p.log], ["tier.lookup", "position"])

    def test_slow_read_skips_fill(self) -> None:
        """A database read slower than half the tier TTL does not fill the tier."""
        p = Process(self.tier, self.clock)
        d = p.store.get_user("@a")
        self.clock.advance(TTL_S / 2 + 1)
        p.store.answer_with("v")
        self.assertEqual(self.successResultOf(d), "v")
        self.assertNotIn("tier.fill", [e[0] for e in p.log])
        self.assertIn(("@a",), p.store.get_user.cache)

    def test_tier_errors_fall_back_to_the_database(self) -> None:
        """A failing tier look-up or fill does not fail the read."""
        class Broken(FakeCacheTier):
            def lookup(self, name: str, key: Any) -> Deferred[Any]:
                return fail(ConnectionError("redis down"))

            def fill(self, name: str, key: Any, value: Any, position: int) -> Deferred[bool]:
                raise ConnectionError("redis down")

        p = Process(Broken(), self.clock)
        d = p.store.get_user("@a")
        p.store.answer_with("v")
        self.assertEqual(self.successResultOf(d), "v")
        self.assertEqual(self.successResultOf(p.store.get_user("@a")), "v")

    def test_without_tier_the_cache_is_local(self) -> None:
        """A tier=True cache in a process without a tier reads the database directly."""
        store = TierStore()
        CacheRegistry(CacheConfig()).register(store)
        d = store.get_user("@a")
        store.answer_with("v")
        self.assertEqual(self.successResultOf(d), "v")
        self.assertFalse(store.get_user.uses_tier)


class RedisReadThroughTest(TestCase):
    def setUp(self) -> None:
        require_redis()
        self.prefix = redis_prefix()
        config = CacheConfig(tier=RedisConfig(host=REDIS_HOST, port=REDIS_PORT), tier_ttl_s=TTL_S,
                             cache_invalidator_instances=INVALIDATORS)
        tier = open_tier(reactor, config, self.prefix)
        assert tier is not None
        self.tier = tier
        self.addCleanup(lambda: Deferred.fromCoroutine(self._cleanup()))

    async def _cleanup(self) -> None:
        keys = await self.tier.client.keys(f"{self.prefix}:*")
        if keys:
            await self.tier.client.delete(*keys)
        await self.tier.close()

    async def test_stale_fill_race_against_redis(self) -> None:
        """Against real Redis: the slow reader's fill is refused once the invalidator applied a later invalidation."""
        clock = Clock()
        invalidator_registry = CacheRegistry(CacheConfig())
        invalidator_registry.register(TierStore)
        invalidator = TierInvalidator(self.tier, invalidator_registry, "inv1", INVALIDATORS, clock)
        await wait_connected(self.tier)
        invalidator.startService()
        self.addCleanup(invalidator.stopService)
        await self.tier.lookup("x", ("y",))  # one connection: the floor is written before this answers
        reader = Process(self.tier, clock)
        reader.position = 5
        d = reader.store.get_user("@bob")
        while not reader.store.gates:  # the tier look-up goes over the network
            await _tick()
        invalidator.row_handler("writer", 7, [CachesRow("tier_get_user", ("@bob",), 0)])
        while invalidator.applied < 1:
            await _tick()
        reader.store.answer_with("Bob")
        self.assertEqual(await d, "Bob")
        fill = reader.log[-1]
        self.assertEqual(fill, ("tier.fill", ("@bob",), "Bob", 5))
        self.assertFalse(await self.tier.fill("tier_get_user", ("@bob",), "Bob", 5))
        self.assertIsNone(await self.tier.lookup("tier_get_user", ("@bob",)))
        self.assertEqual(await self.tier.tombstone("tier_get_user", ("@bob",)), 7)


def _tick() -> Deferred[None]:
    d: Deferred[None] = Deferred()
    reactor.callLater(0.005, d.callback, None)
    return d
