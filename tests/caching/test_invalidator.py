"""The cache invalidator: key ownership, applying rows to the tier, retries, the backlog bound, floors."""

from __future__ import annotations

import random
from typing import Any

from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from synflow.backoff import Backoff
from synflow.caching import (
    CURRENT_STATE_CACHE_NAME,
    CacheRegistry,
    FakeCacheTier,
    TierInvalidator,
    cached,
    owns_key,
)
from synflow.config import CacheConfig
from synflow.streams import CachesRow
from tests.caching.stores import RoomStore, sample

INVALIDATORS = ["inv1", "inv2", "inv3"]


class TierStores:
    """Declarations the invalidator needs: tier caches keyed by room, by user, and plain."""

    @cached(name="t_members", tier=True, room_key=True)
    def get_members(self, room_id: str) -> Any: ...

    @cached(name="t_rooms_for_user", tier=True, user_key=True)
    def get_rooms_for_user(self, user_id: str) -> Any: ...

    @cached(name="t_profile", tier=True)
    def get_profile(self, user_id: str) -> Any: ...

    @cached(name="t_local_only")
    def get_local(self, user_id: str) -> Any: ...


def row(name: str, keys: tuple[Any, ...] | None) -> CachesRow:
    return CachesRow(name, keys, 0)


class OwnershipTest(SynchronousTestCase):
    def test_each_key_has_exactly_one_owner(self) -> None:
        """Every key is owned by exactly one invalidator, and keys spread over all of them."""
        owners = []
        for i in range(300):
            key = (f"@user{i}:hs",)
            mine = [inv for inv in INVALIDATORS if owns_key(inv, "get_user", key, INVALIDATORS)]
            self.assertEqual(len(mine), 1)
            owners.append(mine[0])
        self.assertEqual(set(owners), set(INVALIDATORS))

    def test_whole_cache_owned_by_every_invalidator(self) -> None:
        """A whole-cache (None key) invalidation is applied by every invalidator."""
        self.assertTrue(all(owns_key(inv, "get_user", None, INVALIDATORS) for inv in INVALIDATORS))
        self.assertFalse(owns_key("stranger", "get_user", None, INVALIDATORS))

    def test_ownership_is_stable(self) -> None:
        """Ownership depends only on cache name, key and the ordered list."""
        key = ("@a:hs",)
        first = [owns_key(inv, "c", key, INVALIDATORS) for inv in INVALIDATORS]
        self.assertEqual(first, [owns_key(inv, "c", key, list(INVALIDATORS)) for inv in INVALIDATORS])
        self.assertTrue(owns_key("only", "c", key, ["only"]))


class FlakyTier(FakeCacheTier):
    """A fake tier whose invalidations can be made to fail or to wait."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failing = False
        self.held: list[Deferred[None]] | None = None
        self.calls: list[tuple[str, Any, int]] = []

    def invalidate(self, name: str, key: Any, position: int) -> Deferred[None]:
        self.calls.append((name, key, position))
        if self.failing:
            return fail(ConnectionError("redis down"))
        if self.held is not None:
            d: Deferred[None] = Deferred()
            d.addCallback(lambda _: super(FlakyTier, self).invalidate(name, key, position))
            self.held.append(d)
            return d
        return super().invalidate(name, key, position)


class TierInvalidatorTest(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.tier = FlakyTier(invalidators=INVALIDATORS)
        self.registry = CacheRegistry(CacheConfig())
        self.registry.register(TierStores)
        self.registry.register(RoomStore)  # local-only caches, also declared

    def make(self, instance: str = "inv1", **kwargs: Any) -> TierInvalidator:
        inv = TierInvalidator(self.tier, self.registry, instance, INVALIDATORS, self.clock,
                              rng=random.Random(0), **kwargs)
        inv.startService()
        self.addCleanup(inv.stopService)
        return inv

    def test_applies_only_owned_keys(self) -> None:
        """Each invalidator applies the keys it owns; together they apply every key once."""
        invs = [self.make(name) for name in INVALIDATORS]
        keys = [(f"@u{i}",) for i in range(30)]
        for inv in invs:
            inv.row_handler("writer", 5, [row("t_profile", k) for k in keys])
        self.assertEqual(sorted(k for (_n, k, _p) in self.tier.calls), sorted(keys))
        for k in keys:
            self.assertEqual(self.successResultOf(self.tier.tombstone("t_profile", k)), 5)

    def test_whole_cache_by_everyone_and_local_caches_skipped(self) -> None:
        """Null-key rows go to the tier from every invalidator; caches without tier=True are skipped."""
        invs = [self.make(name) for name in INVALIDATORS]
        for inv in invs:
            inv.row_handler("writer", 9, [row("t_profile", None), row("t_local_only", ("@a",)),
                                          row("get_display_name", None)])
        self.assertEqual(self.tier.calls, [("t_profile", None, 9)] * 3)

    def test_unknown_names_go_to_the_tier(self) -> None:
        """A name the invalidator has no declaration for is applied to the tier anyway."""
        inv = self.make("inv1")
        inv.row_handler("writer", 3, [row("somebody_elses_cache", None)])
        self.assertEqual(self.tier.calls, [("somebody_elses_cache", None, 3)])

    def test_batched_name_expands(self) -> None:
        """cs_cache_fake reaches the room-keyed tier caches and the members' user-keyed tier caches."""
        invs = [self.make(name) for name in INVALIDATORS]
        for inv in invs:
            inv.row_handler("writer", 11, [row(CURRENT_STATE_CACHE_NAME, ("!r", "@a", "@b"))])
        self.assertEqual(sorted(self.tier.calls), [
            ("t_members", ("!r",), 11), ("t_rooms_for_user", ("@a",), 11), ("t_rooms_for_user", ("@b",), 11),
        ])

    def test_failures_are_retried_with_backoff(self) -> None:
        """A failed tier invalidation is retried after the backoff delay until it succeeds."""
        inv = self.make("inv1", backoff=Backoff(initial_s=1.0, multiplier=2.0, max_s=4.0, jitter=0.0))
        self.tier.failing = True
        inv.row_handler("writer", 4, [row("t_profile", None)])
        self.assertEqual(len(self.tier.calls), 1)
        self.assertEqual(inv.pending, 1)
        self.clock.advance(1.0)
        self.assertEqual(len(self.tier.calls), 2)
        inv.row_handler("writer", 6, [row("t_profile", None)])  # coalesces with the retry
        self.assertEqual(inv.pending, 1)
        self.clock.advance(1.9)
        self.assertEqual(len(self.tier.calls), 2)  # second delay is 2 s
        self.tier.failing = False
        self.clock.advance(0.1)
        self.assertEqual(self.tier.calls[-1], ("t_profile", None, 6))
        self.assertEqual(inv.pending, 0)
        self.assertEqual(self.successResultOf(self.tier.tombstone("t_profile", None)), 6)

    def test_backlog_collapses_to_whole_cache(self) -> None:
        """When the backlog is full, the busiest cache's keys become one whole-cache invalidation at their maximum."""
        overflows = sample("synflow_cache_invalidator_overflows_total")
        inv = self.make("inv1", max_pending=4, concurrency=1)
        self.tier.held = []
        keys = [k for k in ((f"@u{i}",) for i in range(200)) if owns_key("inv1", "t_profile", k, INVALIDATORS)]
        inv.row_handler("writer", 1, [row("t_profile", keys[0])])  # in flight, held
        for i, k in enumerate(keys[1:6], start=2):
            inv.row_handler("writer", i, [row("t_profile", k)])
        # Four keys filled the backlog; the fifth collapsed them into one whole-cache entry.
        self.assertEqual(inv.pending, 2)
        self.assertEqual(sample("synflow_cache_invalidator_overflows_total") - overflows, 1)
        held = self.tier.held
        self.tier.held = None
        held[0].callback(None)
        self.assertEqual(inv.pending, 0)
        self.assertEqual(self.successResultOf(self.tier.tombstone("t_profile", keys[0])), 1)
        self.assertEqual(self.successResultOf(self.tier.tombstone("t_profile", None)), 5)
        self.assertEqual(self.successResultOf(self.tier.tombstone("t_profile", keys[5])), 6)

    def test_start_raises_floor_and_rewrites_a_lost_one(self) -> None:
        """On start the floor rises to the start position; if Redis loses it, it is rewritten at the highest ID seen."""
        inv = self.make("inv1", start_position=lambda: 40, floor_interval_s=1.0)
        key = next(k for k in ((f"@u{i}",) for i in range(100)) if owns_key("inv1", "t_profile", k, INVALIDATORS))
        self.assertFalse(self.successResultOf(self.tier.fill("t_profile", key, "v", 39)))
        self.assertTrue(self.successResultOf(self.tier.fill("t_profile", key, "v", 40)))
        inv.row_handler("writer", 55, [row("t_local_only", ("@x",))])
        self.tier.flush()  # Redis restarted empty: tombstones and floors are gone
        self.assertFalse(self.successResultOf(self.tier.fill("t_profile", key, "v", 50)))
        self.clock.advance(1.0)
        self.assertFalse(self.successResultOf(self.tier.fill("t_profile", key, "v", 54)))
        self.assertTrue(self.successResultOf(self.tier.fill("t_profile", key, "v", 55)))

    def test_stop_waits_for_requests_in_flight(self) -> None:
        """stopService's Deferred fires once the tier requests in flight have finished."""
        inv = TierInvalidator(self.tier, self.registry, "inv1", INVALIDATORS, self.clock)
        inv.startService()
        self.tier.held = []
        inv.row_handler("writer", 2, [row("t_profile", None)])
        d = inv.stopService()
        self.assertNoResult(d)
        self.tier.held.pop().callback(None)
        self.successResultOf(d)

    def test_instance_must_be_listed(self) -> None:
        """An invalidator that is not in cache_invalidator_instances is refused."""
        with self.assertRaises(ValueError):
            TierInvalidator(self.tier, self.registry, "stranger", INVALIDATORS, self.clock)
