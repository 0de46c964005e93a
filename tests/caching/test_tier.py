"""The shared tier's rules, run against the in-memory fake and against real Redis."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from synflow.caching import CacheTier, FakeCacheTier, open_tier
from synflow.caching.tier import TierUnavailable, key_owner
from synflow.config import CacheConfig, RedisConfig
from tests.services import REDIS_HOST, REDIS_PORT, redis_prefix, require_redis

INVALIDATORS = ["inv1", "inv2"]
TTL_S = 60.0


def keys_owned_by(instance: str, n: int = 2, cache: str = "c") -> list[tuple[str]]:
    """``n`` keys of cache ``cache`` that ``instance`` owns."""
    found: list[tuple[str]] = []
    i = 0
    while len(found) < n:
        key = (f"@user{i}",)
        if key_owner(cache, key, INVALIDATORS) == instance:
            found.append(key)
        i += 1
    return found


if TYPE_CHECKING:
    _Base = TestCase
else:
    _Base = object


class TierContract(_Base):
    """The tier's semantics; subclasses say which tier (the same body runs on each)."""

    tier: Any

    def make_tier(self) -> Any:
        raise NotImplementedError

    async def connected_tier(self) -> Any:
        """A tier ready for requests."""
        return self.make_tier()

    async def ready_tier(self) -> Any:
        """A tier whose invalidators have both written their floor at 0."""
        tier = await self.connected_tier()
        for inv in INVALIDATORS:
            await tier.raise_floor(inv, 0)
        return tier

    async def test_fill_then_lookup(self) -> None:
        """A fill is visible to look-ups with its fill position; values round-trip through JSON."""
        tier = await self.ready_tier()
        self.assertIsNone(await tier.lookup("c", ("@a",)))
        self.assertEqual(await tier.get("c", ("@a",)), (False, None))
        self.assertTrue(await tier.fill("c", ("@a",), {"name": "A", "rooms": ("!r",)}, 5))
        self.assertEqual(await tier.lookup("c", ("@a",)), ({"name": "A", "rooms": ["!r"]}, 5))
        self.assertTrue(await tier.fill("c", ("@none",), None, 5))
        self.assertEqual(await tier.get("c", ("@none",)), (True, None))

    async def test_stale_fill_race_refused(self) -> None:
        """A reader's fill at position p arriving after an invalidation i > p was applied is refused."""
        tier = await self.ready_tier()
        key = ("@bob",)
        # The reader misses and reads the database at position 5: the old value.
        self.assertIsNone(await tier.lookup("get_user", key))
        position, old_value = 5, {"name": "Bob"}
        # A writer changes the value and records invalidation 7; the invalidator applies it.
        await tier.invalidate("get_user", key, 7)
        # The reader's delayed fill arrives: refused, so the stale value never lands.
        self.assertFalse(await tier.fill("get_user", key, old_value, position))
        self.assertIsNone(await tier.lookup("get_user", key))
        # A reader that has seen invalidation 7 may fill.
        self.assertTrue(await tier.fill("get_user", key, {"name": "Robert"}, 7))
        self.assertEqual(await tier.get("get_user", key), (True, {"name": "Robert"}))

    async def test_tombstones_survive_value_deletion(self) -> None:
        """Invalidating deletes the value but keeps the highest invalidation ID as the key's tombstone."""
        tier = await self.ready_tier()
        key = ("@a",)
        self.assertTrue(await tier.fill("c", key, "v1", 3))
        await tier.invalidate("c", key, 6)
        self.assertIsNone(await tier.lookup("c", key))
        self.assertEqual(await tier.tombstone("c", key), 6)
        await tier.invalidate("c", key, 4)  # out of order: the tombstone keeps the maximum
        self.assertEqual(await tier.tombstone("c", key), 6)
        self.assertFalse(await tier.fill("c", key, "v-stale", 5))
        self.assertTrue(await tier.fill("c", key, "v2", 6))
        self.assertEqual(await tier.tombstone("c", key), 6)
        self.assertEqual(await tier.lookup("c", key), ("v2", 6))
        self.assertIsNone(await tier.tombstone("c", ("@never",)))

    async def test_whole_cache_invalidation(self) -> None:
        """invalidate(name, None, pos) hides values filled below pos and refuses such fills, in that cache only."""
        tier = await self.ready_tier()
        self.assertTrue(await tier.fill("c", ("@old",), "o", 3))
        self.assertTrue(await tier.fill("c", ("@new",), "n", 8))
        self.assertTrue(await tier.fill("other", ("@old",), "x", 3))
        await tier.invalidate("c", None, 5)
        self.assertIsNone(await tier.lookup("c", ("@old",)))
        self.assertEqual(await tier.lookup("c", ("@new",)), ("n", 8))
        self.assertEqual(await tier.lookup("other", ("@old",)), ("x", 3))
        self.assertFalse(await tier.fill("c", ("@old",), "o", 4))
        self.assertTrue(await tier.fill("c", ("@old",), "o2", 5))
        self.assertEqual(await tier.tombstone("c", None), 5)
        await tier.invalidate("c", None, 2)  # older: the cache tombstone keeps the maximum
        self.assertEqual(await tier.tombstone("c", None), 5)

    async def test_older_fill_does_not_replace_newer(self) -> None:
        """A fill read at a lower position than the stored value's is refused."""
        tier = await self.ready_tier()
        self.assertTrue(await tier.fill("c", ("@a",), "new", 9))
        self.assertFalse(await tier.fill("c", ("@a",), "old", 7))
        self.assertEqual(await tier.lookup("c", ("@a",)), ("new", 9))
        self.assertTrue(await tier.fill("c", ("@a",), "same", 9))

    async def test_floors(self) -> None:
        """No fill lands without the owner's floor; raising a floor hides values filled below it."""
        tier = await self.connected_tier()
        mine, theirs = keys_owned_by("inv1", 1)[0], keys_owned_by("inv2", 1)[0]
        self.assertFalse(await tier.fill("c", mine, "v", 5))
        self.assertTrue(await tier.raise_floor("inv1", 0))
        self.assertTrue(await tier.fill("c", mine, "v", 5))
        self.assertFalse(await tier.fill("c", theirs, "v", 5))  # inv2 has no floor yet
        self.assertTrue(await tier.ensure_floor("inv2", 3))
        self.assertFalse(await tier.ensure_floor("inv2", 10))  # present: left alone
        self.assertFalse(await tier.fill("c", theirs, "v", 2))
        self.assertTrue(await tier.fill("c", theirs, "v", 3))
        self.assertTrue(await tier.raise_floor("inv1", 10))
        self.assertFalse(await tier.raise_floor("inv1", 4))
        self.assertIsNone(await tier.lookup("c", mine))
        self.assertFalse(await tier.fill("c", mine, "v", 9))
        self.assertTrue(await tier.fill("c", mine, "v", 10))
        self.assertEqual(await tier.lookup("c", theirs), ("v", 3))


class FakeTierTest(TierContract, TestCase):
    def make_tier(self) -> FakeCacheTier:
        return FakeCacheTier(TTL_S, invalidators=INVALIDATORS)

    async def test_expiry(self) -> None:
        """Values and tombstones live ttl_s after their last write, then expire."""
        clock = Clock()
        tier = FakeCacheTier(TTL_S, invalidators=INVALIDATORS, clock=clock)
        for inv in INVALIDATORS:
            await tier.raise_floor(inv, 0)
        await tier.fill("c", ("@a",), "v", 1)
        await tier.invalidate("c", ("@b",), 4)
        await tier.invalidate("c", None, 2)
        clock.advance(TTL_S - 1)
        self.assertEqual(await tier.tombstone("c", ("@b",)), 4)
        self.assertEqual(await tier.tombstone("c", None), 2)
        clock.advance(1)
        self.assertIsNone(await tier.lookup("c", ("@a",)))
        self.assertIsNone(await tier.tombstone("c", ("@b",)))
        self.assertIsNone(await tier.tombstone("c", None))

    async def test_flush_forgets_floors(self) -> None:
        """After a flush (a Redis that lost its data) nothing is stored until a floor is written again."""
        tier = await self.ready_tier()
        tier.flush()
        self.assertFalse(await tier.fill("c", ("@a",), "v", 100))


class RedisTierTest(TierContract, TestCase):
    def setUp(self) -> None:
        require_redis()
        self.prefix = redis_prefix()
        self._tiers: list[CacheTier] = []
        self.addCleanup(lambda: Deferred.fromCoroutine(self._cleanup()))

    async def connected_tier(self) -> Any:
        tier = self.make_tier()
        await wait_connected(tier)
        return tier

    def make_tier(self) -> CacheTier:
        config = CacheConfig(tier=RedisConfig(host=REDIS_HOST, port=REDIS_PORT), tier_ttl_s=TTL_S,
                             cache_invalidator_instances=INVALIDATORS)
        tier = open_tier(reactor, config, self.prefix)
        assert tier is not None
        self._tiers.append(tier)
        return tier

    async def _cleanup(self) -> None:
        for tier in self._tiers:
            keys = await tier.client.keys(f"{self.prefix}:*")
            if keys:
                await tier.client.delete(*keys)
            await tier.close()

    async def test_layout_and_ttl(self) -> None:
        """Entries are hashes under <prefix>:<cache>:<json key> whose tombstone outlives the value, with a TTL."""
        tier = await self.ready_tier()
        await tier.fill("get_user", ("@a:hs",), {"n": 1}, 3)
        entry = f'{self.prefix}:get_user:["@a:hs"]'
        self.assertEqual(json.loads(await tier.client.hget(entry, "v")), {"n": 1})
        await tier.invalidate("get_user", ("@a:hs",), 9)
        self.assertFalse(await tier.client.hexists(entry, "v"))
        self.assertEqual(await tier.client.hget(entry, "t"), "9")
        ttl_s = await tier.client.ttl(entry)
        self.assertTrue(0 < ttl_s <= TTL_S, ttl_s)
        await tier.invalidate("get_user", None, 4)
        self.assertEqual(await tier.client.get(f"{self.prefix}:get_user:all"), "4")
        self.assertTrue(0 < await tier.client.ttl(f"{self.prefix}:get_user:all") <= TTL_S)

    async def test_numeric_looking_values(self) -> None:
        """Values that look like numbers come back as the JSON they were stored as."""
        tier = await self.ready_tier()
        await tier.fill("c", ("k",), "12", 1)
        await tier.fill("c", ("n",), 12, 1)
        self.assertEqual(await tier.get("c", ("k",)), (True, "12"))
        self.assertEqual(await tier.get("c", ("n",)), (True, 12))

    async def test_fails_fast_while_disconnected(self) -> None:
        """Requests fail at once, without queuing, while the tier is not connected."""
        tier = self.make_tier()
        self.assertFalse(tier.connected)
        with self.assertRaises(TierUnavailable):
            await tier.fill("c", ("@a",), "v", 1)
        await wait_connected(tier)
        self.assertIsNone(await tier.lookup("c", ("@a",)))

    def test_no_tier_configured(self) -> None:
        """Without caches.tier there is no tier."""
        self.assertIsNone(open_tier(reactor, CacheConfig(), self.prefix))


async def wait_connected(tier: CacheTier, timeout_s: float = 10.0) -> None:
    """Wait until a tier's lazy connection is up."""
    deadline = reactor.seconds() + timeout_s
    while not tier.connected:
        if reactor.seconds() > deadline:
            raise AssertionError("the tier did not connect to Redis")
        d: Deferred[None] = Deferred()
        reactor.callLater(0.005, d.callback, None)
        await d


class _SlowClient:
    """A txredisapi stand-in whose replies the test delivers by hand."""

    def __init__(self) -> None:
        self.replies: list[Deferred[Any]] = []

    def eval(self, script: str, keys: list[str], args: list[str]) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.replies.append(d)
        return d


class CacheTierTimeoutTest(SynchronousTestCase):
    def test_slow_reply_times_out_and_late_reply_is_ignored(self) -> None:
        """A request unanswered within the timeout fails with TierUnavailable; its late reply changes nothing."""
        clock, client = Clock(), _SlowClient()
        tier = CacheTier(client, "p", TTL_S, invalidators=INVALIDATORS, clock=clock, timeout_s=2.0)
        d = tier.lookup("c", ("@a",))
        clock.advance(1.9)
        self.assertNoResult(d)
        clock.advance(0.1)
        self.failureResultOf(d, TierUnavailable)
        client.replies[0].callback(['"v"', "3"])  # not an error, not delivered twice
        d2 = tier.lookup("c", ("@a",))
        client.replies[1].callback(['"v"', "3"])
        self.assertEqual(self.successResultOf(d2), ("v", 3))
        self.assertEqual(clock.getDelayedCalls(), [])
