"""The cache registry: discovery, sizes, applying caches-stream rows, batched names, writer rows."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from synflow.caching import (
    CURRENT_STATE_CACHE_NAME,
    CacheRegistry,
    FakeCacheTier,
    cached,
    invalidation_rows,
)
from synflow.caching.registry import MAX_ROW_BYTES, MEMBERS_PER_ROW
from synflow.config import CacheConfig
from synflow.errors import ConfigError
from synflow.streams import CachesRow
from tests.caching.stores import DictStore, RoomStore, sample

TS = 1_700_000_000_000
CACHE_ATTRS = ("get_users_in_room", "get_room_summary", "get_rooms_for_user", "get_display_name")


def row(name: str, keys: tuple[Any, ...] | None) -> CachesRow:
    return CachesRow(name, keys, TS)


def contents(store: RoomStore) -> dict[str, list[Any]]:
    """Every cache's keys and values (the observable state of the store's caches)."""
    out = {}
    for attr in CACHE_ATTRS:
        lru = getattr(store, attr).cache
        out[attr] = sorted((k, repr(lru.peek(k))) for k in lru)
    return out


def assert_invalidated(test: SynchronousTestCase, registry: CacheRegistry, store: RoomStore,
                       rows: list[CachesRow]) -> None:
    """Every key each row names (after expanding batched names) is absent; a null key left its cache empty."""
    for r in rows:
        for name, key in registry.expand(r):
            if name not in CACHE_ATTRS:
                continue
            cache = getattr(store, name).cache
            if key is None:
                test.assertEqual(len(cache), 0, f"{name} not cleared by {r}")
            else:
                test.assertNotIn(key, cache, f"{name}{key} not invalidated by {r}")


def warm(store: RoomStore) -> None:
    """Fill every cache of a RoomStore with a few entries."""
    store.members = {"!r1": ["@a", "@b"], "!r2": ["@b", "@c"]}
    store.rooms_of = {"@a": ["!r1"], "@b": ["!r1", "!r2"], "@c": ["!r2"]}
    store.names = {"@a": "A", "@b": "B", "@c": "C"}
    for room in ("!r1", "!r2", "!r3"):
        store.get_users_in_room(room)
        store.get_room_summary(room)
    for user in ("@a", "@b", "@c", "@d"):
        store.get_rooms_for_user(user)
        store.get_display_name(user)


class RegistrationTest(SynchronousTestCase):
    def test_register_discovers_cached_methods(self) -> None:
        """register finds every @cached method of a store, and several stores can register."""
        registry = CacheRegistry(CacheConfig())
        rooms, users = RoomStore(), DictStore()
        self.assertEqual(registry.register(rooms), ["get_display_name", "get_room_summary",
                                                   "get_rooms_for_user", "get_users_in_room"])
        registry.register(users)
        self.assertEqual(registry.caches("get_user"), [users.get_user])
        self.assertIn("get_pair", registry.names)
        registry.register(users)  # idempotent
        self.assertEqual(len(registry.caches("get_user")), 1)

    def test_sizes_from_config(self) -> None:
        """caches.sizes[name] beats max_entries, which beats default_size; shrinking evicts."""
        store = DictStore({u: u for u in "abc"})
        for u in "abc":
            store.get_user(u)
        registry = CacheRegistry(CacheConfig(default_size=7, sizes={"get_user": 2}))
        registry.register(store)
        self.assertEqual(store.get_user.cache.max_size, 2)
        self.assertEqual(len(store.get_user.cache), 2)
        self.assertEqual(store.get_pair.cache.max_size, 7)
        other = DictStore()
        CacheRegistry(CacheConfig(default_size=7)).register(other)
        self.assertEqual(other.get_user.cache.max_size, 3)

    def test_conflicting_names_refused(self) -> None:
        """Two different methods declaring one cache name are refused."""
        class A:
            @cached(name="shared")
            def one(self, x: str) -> str:
                return x

        class B:
            @cached(name="shared")
            def two(self, x: str) -> str:
                return x

        registry = CacheRegistry(CacheConfig())
        registry.register(A())
        with self.assertRaises(ValueError):
            registry.register(B())

    def test_tier_needs_position_source(self) -> None:
        """A tier without a caches position source is a configuration error."""
        with self.assertRaises(ConfigError):
            CacheRegistry(CacheConfig(), tier=FakeCacheTier())


class ApplyTest(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(TS / 1000)
        self.registry = CacheRegistry(CacheConfig(), clock=self.clock)
        self.store = RoomStore()
        self.registry.register(self.store)
        warm(self.store)

    def test_key_row_invalidates_that_key(self) -> None:
        """A row with keys drops that key from the named cache only."""
        self.registry.apply([row("get_display_name", ("@a",))])
        self.assertNotIn(("@a",), self.store.get_display_name.cache)
        self.assertIn(("@b",), self.store.get_display_name.cache)
        self.assertIn(("@a",), self.store.get_rooms_for_user.cache)

    def test_null_key_clears_the_cache(self) -> None:
        """A row with null keys clears the whole named cache."""
        self.registry.apply([row("get_display_name", None)])
        self.assertEqual(len(self.store.get_display_name.cache), 0)
        self.assertEqual(len(self.store.get_rooms_for_user.cache), 4)

    def test_unknown_names_ignored_and_counted(self) -> None:
        """A row naming a cache this process lacks changes nothing and is counted."""
        before_count = sample("synflow_cache_unknown_invalidations_total")
        before = contents(self.store)
        self.registry.apply([row("no_such_cache", ("x",)), row("no_such_cache", None)])
        self.assertEqual(contents(self.store), before)
        self.assertEqual(sample("synflow_cache_unknown_invalidations_total") - before_count, 2)

    def test_batched_current_state_name(self) -> None:
        """cs_cache_fake clears the room from every room-keyed cache and each member from user-keyed ones."""
        self.registry.apply([row(CURRENT_STATE_CACHE_NAME, ("!r1", "@a", "@d"))])
        for cache in (self.store.get_users_in_room, self.store.get_room_summary):
            self.assertEqual(sorted(cache.cache), [("!r2",), ("!r3",)])
        self.assertEqual(sorted(self.store.get_rooms_for_user.cache), [("@b",), ("@c",)])
        self.assertEqual(len(self.store.get_display_name.cache), 4)  # not keyed by user

    def test_batched_name_without_members(self) -> None:
        """A cs_cache_fake row with only a room ID touches no user-keyed cache."""
        self.registry.apply([row(CURRENT_STATE_CACHE_NAME, ("!r2",))])
        self.assertEqual(sorted(self.store.get_users_in_room.cache), [("!r1",), ("!r3",)])
        self.assertEqual(len(self.store.get_rooms_for_user.cache), 4)

    def test_batched_name_with_null_keys_clears_conservatively(self) -> None:
        """A (malformed) cs_cache_fake row with null keys clears every room- and user-keyed cache."""
        self.registry.apply([row(CURRENT_STATE_CACHE_NAME, None)])
        self.assertEqual(len(self.store.get_users_in_room.cache), 0)
        self.assertEqual(len(self.store.get_rooms_for_user.cache), 0)
        self.assertEqual(len(self.store.get_display_name.cache), 4)

    def test_wire_rows_with_nested_keys(self) -> None:
        """Rows parsed from the wire (nested lists in keys) are applied as hashable tuples."""
        class S:
            @cached
            def get_device(self, pair: tuple[str, str]) -> str:
                return "d"

        s = S()
        self.registry.register(s)
        s.get_device(("@a", "DEV"))
        self.registry.apply([CachesRow.from_wire(["get_device", [["@a", "DEV"]], TS])])
        self.assertEqual(len(s.get_device.cache), 0)

    def test_row_handler_and_local_invalidation(self) -> None:
        """The replication row handler and invalidate_local both invalidate."""
        self.registry.row_handler("master", 12, [row("get_display_name", ("@a",))])
        self.registry.invalidate_local("get_display_name", ["@b"])
        self.registry.invalidate_local(CURRENT_STATE_CACHE_NAME, ["!r3"])
        self.registry.apply_local([row("get_rooms_for_user", None)])
        self.assertEqual(sorted(self.store.get_display_name.cache), [("@c",), ("@d",)])
        self.assertNotIn(("!r3",), self.store.get_users_in_room.cache)
        self.assertEqual(len(self.store.get_rooms_for_user.cache), 0)

    def test_invalidation_lag_metric(self) -> None:
        """apply observes now - invalidation_ts in the lag histogram, with the injected clock."""
        count = sample("synflow_cache_invalidation_lag_seconds_count")
        total = sample("synflow_cache_invalidation_lag_seconds_sum")
        self.clock.advance(2.5)
        self.registry.apply([row("get_display_name", ("@a",)), row("unknown", None)])
        self.assertEqual(sample("synflow_cache_invalidation_lag_seconds_count") - count, 2)
        self.assertAlmostEqual(sample("synflow_cache_invalidation_lag_seconds_sum") - total, 5.0, places=3)


ROOMS = ["!r1", "!r2", "!r3"]
USERS = ["@a", "@b", "@c", "@d"]
NAMES = ["get_users_in_room", "get_room_summary", "get_rooms_for_user", "get_display_name", "unknown"]

rows_strategy = st.one_of(
    st.builds(lambda n, k: row(n, (k,)), st.sampled_from(NAMES), st.sampled_from(ROOMS + USERS)),
    st.builds(lambda n: row(n, None), st.sampled_from(NAMES)),
    st.builds(lambda r, ms: row(CURRENT_STATE_CACHE_NAME, (r, *ms)),
              st.sampled_from(ROOMS), st.lists(st.sampled_from(USERS), max_size=3)),
)


class CommuteTest(SynchronousTestCase):
    @given(
        writer_a=st.lists(rows_strategy, max_size=6),
        writer_b=st.lists(rows_strategy, max_size=6),
        data=st.data(),
    )
    def test_any_interleaving_gives_the_same_caches(self, writer_a: list[CachesRow],
                                                    writer_b: list[CachesRow], data: Any) -> None:
        """Two writers' rows applied in any order (and any repeated) leave the same cache contents."""
        rows = writer_a + writer_b
        reference = RoomStore()
        registry = CacheRegistry(CacheConfig())
        registry.register(reference)
        warm(reference)
        registry.apply(rows)
        expected = contents(reference)
        assert_invalidated(self, registry, reference, rows)

        shuffled = data.draw(st.permutations(rows))
        repeats = data.draw(st.lists(st.sampled_from(rows), max_size=3)) if rows else []
        other = RoomStore()
        registry2 = CacheRegistry(CacheConfig())
        registry2.register(other)
        warm(other)
        for r in shuffled + repeats:
            registry2.apply([r])
        self.assertEqual(contents(other), expected)
        assert_invalidated(self, registry2, other, rows)


class InvalidationRowsTest(SynchronousTestCase):
    def test_plain_rows(self) -> None:
        """Entries become rows in order, with duplicates dropped."""
        rows = invalidation_rows(TS, [("get_user", ("@a",)), ("get_user", None), ("get_user", ["@a"])])
        self.assertEqual(rows, [row("get_user", ("@a",)), row("get_user", None)])

    def test_current_state_rows_are_chunked(self) -> None:
        """A current-state change becomes cs_cache_fake rows of at most 50 members each."""
        members = [f"@user{i}:example.com" for i in range(120)]
        rows = invalidation_rows(TS, current_state={"!room:hs": members, "!quiet:hs": []})
        self.assertEqual([len(r.keys or ()) for r in rows], [51, 51, 21, 1])
        self.assertTrue(all(r.cache_name == CURRENT_STATE_CACHE_NAME for r in rows))
        self.assertEqual([m for r in rows[:3] for m in (r.keys or ())[1:]], members)
        self.assertEqual(MEMBERS_PER_ROW, 50)

    def test_invalid_rows_refused(self) -> None:
        """Batched names as entries, keys that are not JSON, and oversized rows are refused."""
        with self.assertRaises(ValueError):
            invalidation_rows(TS, [(CURRENT_STATE_CACHE_NAME, ("!r",))])
        with self.assertRaises(ValueError):
            invalidation_rows(TS, [("get_user", (object(),))])
        with self.assertRaises(ValueError):
            invalidation_rows(TS, [("get_user", ("x" * MAX_ROW_BYTES,))])

    def test_rows_round_trip_the_wire(self) -> None:
        """Rows built for writers survive to_wire/from_wire unchanged."""
        for r in invalidation_rows(TS, [("get_user", ("@a",)), ("get_user", None)],
                                   current_state={"!r": ["@a", "@b"]}):
            self.assertEqual(CachesRow.from_wire(r.to_wire()), r)
