"""``@cached``: the per-process LRU, shared reads, failures, in-flight invalidation, metrics."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.trial.unittest import SynchronousTestCase

from synflow.caching import CachedMethod, cached
from synflow.caching.descriptors import CachedDescriptor
from tests.caching.stores import DictStore, GatedStore, sample


def exposition() -> dict[tuple[str, str], float]:
    """``(sample name, cache label) -> value`` parsed from the Prometheus text exposition."""
    return {
        (sample.name, sample.labels.get("cache", "")): sample.value
        for family in text_string_to_metric_families(generate_latest().decode())
        for sample in family.samples
    }


class LruTest(SynchronousTestCase):
    def test_hit_after_miss(self) -> None:
        """A second call with the same arguments is answered from the cache without a read."""
        store = DictStore({"@a": "Alice"})
        self.assertEqual(self.successResultOf(store.get_user("@a")), "Alice")
        self.assertEqual(self.successResultOf(store.get_user("@a")), "Alice")
        self.assertEqual(store.reads, [("get_user", "@a")])

    def test_bound_and_eviction_metrics(self) -> None:
        """The cache holds at most max_entries, evicts the least recently used, and counts evictions."""
        store = DictStore({u: u.upper() for u in "abcde"})
        before = sample("synflow_cache_evictions_total", cache="get_user")
        for u in "abc":
            store.get_user(u)
        store.get_user("a")  # a is now the most recently used
        store.get_user("d")  # evicts b
        self.assertEqual(len(store.get_user.cache), 3)
        self.assertEqual(sorted(store.get_user.cache), [("a",), ("c",), ("d",)])
        store.get_user("e")  # evicts c
        self.assertEqual(sample("synflow_cache_evictions_total", cache="get_user") - before, 2)
        self.assertEqual(store.get_user.cache.max_size, 3)

    def test_hits_misses_and_size_metrics(self) -> None:
        """Hits, misses, invalidations and the size gauge follow the calls."""
        hits = sample("synflow_cache_hits_total", cache="get_pair")
        misses = sample("synflow_cache_misses_total", cache="get_pair")
        size = sample("synflow_cache_size", cache="get_pair")
        store = DictStore()
        store.get_pair("x")
        store.get_pair("x")
        store.get_pair("y")
        self.assertEqual(sample("synflow_cache_hits_total", cache="get_pair") - hits, 1)
        self.assertEqual(sample("synflow_cache_misses_total", cache="get_pair") - misses, 2)
        self.assertEqual(sample("synflow_cache_size", cache="get_pair") - size, 2)
        invalidations = sample("synflow_cache_invalidations_total", cache="get_pair")
        store.get_pair.invalidate(("x", "default"))
        store.get_pair.invalidate_all()
        self.assertEqual(sample("synflow_cache_size", cache="get_pair") - size, 0)
        self.assertEqual(sample("synflow_cache_invalidations_total", cache="get_pair") - invalidations, 2)

    def test_metrics_in_exposition(self) -> None:
        """The text exposition carries each cache's hits, misses, invalidations, evictions and size, with their values."""
        store = DictStore({"@a": 1})
        before = exposition()
        store.get_user("@a")
        store.get_user("@a")
        filled = exposition()
        store.get_user.invalidate(("@a",))
        for u in ("@b", "@c", "@d", "@e"):
            store.get_user(u)  # the fourth evicts one (max_entries=3)
        after = exposition()

        def delta(name: str, since: dict[tuple[str, str], float], now: dict[tuple[str, str], float]) -> float:
            return now.get((name, "get_user"), 0.0) - since.get((name, "get_user"), 0.0)

        self.assertEqual(delta("synflow_cache_hits_total", before, filled), 1)
        self.assertEqual(delta("synflow_cache_misses_total", before, filled), 1)
        self.assertEqual(delta("synflow_cache_size", before, filled), 1)
        self.assertEqual(delta("synflow_cache_invalidations_total", filled, after), 1)
        self.assertEqual(delta("synflow_cache_misses_total", filled, after), 4)
        self.assertEqual(delta("synflow_cache_evictions_total", filled, after), 1)
        self.assertEqual(delta("synflow_cache_size", before, after), 3)

    def test_keys_normalise_keywords_and_defaults(self) -> None:
        """Keyword arguments and defaults map to the same positional key tuple."""
        store = DictStore()
        store.get_pair("a")
        store.get_pair("a", "default")
        store.get_pair(a="a", b="default")
        self.assertEqual(store.reads, [("get_pair", "a", "default")])
        self.assertIn(("a", "default"), store.get_pair.cache)

    def test_unhashable_arguments_raise(self) -> None:
        """An unhashable argument raises TypeError naming the cache, and nothing is read."""
        store = DictStore()
        with self.assertRaises(TypeError) as e:
            store.get_user(["@a"])
        self.assertIn("get_user", str(e.exception))
        self.assertEqual(store.reads, [])

    def test_each_store_object_has_its_own_cache(self) -> None:
        """Two store objects of one class keep separate caches."""
        one, two = DictStore({"@a": 1}), DictStore({"@a": 2})
        self.assertEqual(self.successResultOf(one.get_user("@a")), 1)
        self.assertEqual(self.successResultOf(two.get_user("@a")), 2)
        self.assertIsNot(one.get_user, two.get_user)
        self.assertIs(one.get_user, one.get_user)
        self.assertIsInstance(DictStore.get_user, CachedDescriptor)

    def test_prefill(self) -> None:
        """A prefilled value is answered without a read."""
        store = DictStore()
        store.get_user.prefill(("@new",), "New")
        self.assertEqual(self.successResultOf(store.get_user("@new")), "New")
        self.assertEqual(store.reads, [])

    def test_bare_decorator_and_coroutines(self) -> None:
        """@cached works bare, and on a coroutine method."""
        class S:
            @cached
            async def get_thing(self, x: int) -> int:
                return x * 2

        s = S()
        self.assertEqual(self.successResultOf(s.get_thing(4)), 8)
        self.assertIn((4,), s.get_thing.cache)

    def test_bad_declarations(self) -> None:
        """Variadic or keyword-only parameters, and room/user keys of the wrong arity, are refused."""
        with self.assertRaises(TypeError):
            cached()(lambda self, *args: None)
        with self.assertRaises(TypeError):
            cached()(lambda self, *, k: None)
        with self.assertRaises(TypeError):
            cached(room_key=True)(lambda self, room_id, user_id: None)
        with self.assertRaises(ValueError):
            cached(room_key=True, user_key=True)(lambda self, x: None)
        with self.assertRaises(ValueError):
            cached(max_entries=0)(lambda self, x: None)


class InFlightTest(SynchronousTestCase):
    def test_concurrent_misses_share_one_read(self) -> None:
        """Concurrent calls for one key wait for one underlying read and all get its result."""
        store = GatedStore()
        d1, d2, d3 = store.get_profile("@a"), store.get_profile("@a"), store.get_profile("@b")
        self.assertEqual([k for k, _ in store.gates], ["@a", "@b"])
        self.assertNoResult(d1)
        store.gates.pop(0)[1].callback({"name": "A"})
        self.assertEqual(self.successResultOf(d1), {"name": "A"})
        self.assertEqual(self.successResultOf(d2), {"name": "A"})
        self.assertNoResult(d3)
        self.assertEqual(self.successResultOf(store.get_profile("@a")), {"name": "A"})
        self.assertEqual(len(store.gates), 1)

    def test_failure_not_cached_and_shared(self) -> None:
        """A failed read reaches every waiter and is not cached: the next call reads again."""
        store = GatedStore()
        d1, d2 = store.get_profile("@a"), store.get_profile("@a")
        store.gates.pop(0)[1].errback(RuntimeError("db down"))
        self.failureResultOf(d1, RuntimeError)
        self.failureResultOf(d2, RuntimeError)
        self.assertEqual(len(store.get_profile.cache), 0)
        d3 = store.get_profile("@a")
        self.assertEqual(len(store.gates), 1)
        store.gates.pop(0)[1].callback("ok")
        self.assertEqual(self.successResultOf(d3), "ok")

    def test_synchronous_exception_not_cached(self) -> None:
        """A method that raises gives a failed Deferred and caches nothing."""
        calls = []

        class S:
            @cached
            def get_x(self, x: int) -> Any:
                calls.append(x)
                if len(calls) == 1:
                    raise ValueError("boom")
                return x

        s = S()
        self.failureResultOf(s.get_x(1), ValueError)
        self.assertEqual(self.successResultOf(s.get_x(1)), 1)
        self.assertEqual(calls, [1, 1])

    def test_invalidate_during_read_prevents_caching(self) -> None:
        """A read whose key is invalidated while in flight is returned to its callers but not cached."""
        store = GatedStore()
        d1 = store.get_profile("@a")
        store.get_profile.invalidate(("@a",))
        d2 = store.get_profile("@a")  # after the invalidation: a fresh read, not joined to the old one
        self.assertEqual(len(store.gates), 2)
        store.gates.pop(0)[1].callback("old")
        self.assertEqual(self.successResultOf(d1), "old")
        self.assertNotIn(("@a",), store.get_profile.cache)
        store.gates.pop(0)[1].callback("new")
        self.assertEqual(self.successResultOf(d2), "new")
        self.assertEqual(self.successResultOf(store.get_profile("@a")), "new")

    def test_invalidate_all_during_read_prevents_caching(self) -> None:
        """invalidate_all also keeps reads in flight out of the cache."""
        store = GatedStore()
        d1 = store.get_profile("@a")
        store.get_profile.invalidate_all()
        store.gates.pop(0)[1].callback("old")
        self.assertEqual(self.successResultOf(d1), "old")
        self.assertEqual(len(store.get_profile.cache), 0)

    def test_prefill_during_read_wins(self) -> None:
        """A prefill during a read in flight is not overwritten by that read's older result."""
        store = GatedStore()
        d1 = store.get_profile("@a")
        store.get_profile.prefill(("@a",), "written")
        store.gates.pop(0)[1].callback("read-before-write")
        self.assertEqual(self.successResultOf(d1), "read-before-write")
        self.assertEqual(self.successResultOf(store.get_profile("@a")), "written")

    def test_cancelled_waiter_does_not_break_others(self) -> None:
        """One caller cancelling its Deferred neither stops the read nor affects other callers."""
        store = GatedStore()
        d1, d2 = store.get_profile("@a"), store.get_profile("@a")
        d1.cancel()
        self.failureResultOf(d1, CancelledError)
        store.gates.pop(0)[1].callback("v")
        self.assertEqual(self.successResultOf(d2), "v")
        self.assertIn(("@a",), store.get_profile.cache)

    def test_plain_and_deferred_results(self) -> None:
        """Methods returning a plain value, a fired Deferred or a failed Deferred all work."""
        class S:
            @cached
            def plain(self, x: int) -> int:
                return x

            @cached
            def fired(self, x: int) -> Deferred[int]:
                return succeed(x)

            @cached
            def failed(self, x: int) -> Deferred[int]:
                return fail(KeyError(x))

        s = S()
        self.assertEqual(self.successResultOf(s.plain(1)), 1)
        self.assertEqual(self.successResultOf(s.fired(2)), 2)
        self.failureResultOf(s.failed(3), KeyError)
        self.assertIsInstance(s.plain, CachedMethod)
