"""Rate limits: bounded token buckets, and the default limit on a fast ``timeout=0`` sync loop."""

from __future__ import annotations

import json

from twisted.internet.defer import ensureDeferred, gatherResults
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase

from synflow.config import LimitsConfig
from synflow.http.ratelimit import PRUNE_INTERVAL_S, TokenBucket
from synflow.tools.client import PREFIX, ApiError, Client, new_pool
from tests.cluster import single_master

#: The fast loop gives up after this many syncs without a 429 (the default burst is 200).
MAX_LOOP_SYNCS = 5000


class TokenBucketTest(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)

    def test_refusal_says_when_to_retry(self) -> None:
        """Past the burst, take() returns the seconds until the next token, and that wait is enough."""
        bucket = TokenBucket(2.0, 3, self.clock)
        self.assertEqual([bucket.take("k") for _ in range(3)], [0.0, 0.0, 0.0])
        wait = bucket.take("k")
        self.assertAlmostEqual(wait, 0.5)
        self.clock.advance(wait)
        self.assertEqual(bucket.take("k"), 0.0)

    def test_idle_buckets_are_pruned(self) -> None:
        """Buckets idle long enough to be full again are forgotten at the next prune."""
        bucket = TokenBucket(1.0, 5, self.clock)
        for i in range(1000):
            bucket.allow(f"user{i}")
        self.assertEqual(len(bucket), 1000)
        self.clock.advance(PRUNE_INTERVAL_S)
        bucket.allow("fresh")
        self.assertEqual(len(bucket), 1)

    def test_recent_buckets_are_kept_by_pruning(self) -> None:
        """A bucket still refilling survives a prune (its key stays limited)."""
        bucket = TokenBucket(0.01, 2, self.clock)  # refills in 200 s
        bucket.allow("busy")
        bucket.allow("busy")
        self.clock.advance(PRUNE_INTERVAL_S)
        self.assertFalse(bucket.allow("busy"))
        self.assertEqual(len(bucket), 1)

    def test_key_count_is_bounded(self) -> None:
        """Past max_buckets the least recently used keys are dropped."""
        bucket = TokenBucket(1.0, 5, self.clock, max_buckets=100)
        for i in range(1000):
            bucket.allow(f"user{i}")
        self.assertEqual(len(bucket), 100)

    def test_defaults_are_on(self) -> None:
        """Rate limiting of writes and of syncs is on by default."""
        limits = LimitsConfig()
        self.assertIsNotNone(limits.rate_limit_per_s)
        self.assertIsNotNone(limits.sync_rate_limit_per_s)


class SyncLoopTest(TestCase):
    timeout = 180

    async def _raw_sync(self, client: Client) -> tuple[int, dict, dict]:
        response = await client.http.request(
            "GET", client.base_url + PREFIX + "/sync?timeout=0",
            headers={b"Authorization": [b"Bearer " + (client.token or "").encode()]})
        body = json.loads(await response.content())
        return response.code, body, {k: v for k, v in response.headers.getAllRawHeaders()}

    def test_fast_timeout_zero_sync_loop_is_limited(self):
        """Under the default config one client's fast timeout=0 sync loop gets 429 with a retry time."""
        return ensureDeferred(self._loop())

    async def _loop(self) -> None:
        master, url = await single_master(self)
        pool = new_pool()
        self.addCleanup(pool.closeCachedConnections)
        alice = await Client(url, pool).register("alice")
        bob = await Client(url, pool).register("bob")
        refused: list[tuple[int, dict, dict]] = []
        sent = [0]

        async def worker() -> None:
            while not refused and sent[0] < MAX_LOOP_SYNCS:
                sent[0] += 1
                code, body, headers = await self._raw_sync(alice)
                if code == 429:
                    refused.append((code, body, headers))
                else:
                    self.assertEqual(code, 200, body)

        await gatherResults([ensureDeferred(worker()) for _ in range(8)])
        self.assertTrue(refused, f"no 429 after {sent[0]} syncs")
        code, body, headers = refused[0]
        self.assertEqual(body["errcode"], "M_LIMIT_EXCEEDED")
        self.assertGreater(body["retry_after_ms"], 0)
        self.assertGreaterEqual(int(headers[b"Retry-After"][0]), 1)
        # Another user's token is not limited by alice's loop.
        await bob.sync()
        # And alice may sync again once she waited as told.
        from twisted.internet import reactor

        await deferLater(reactor, body["retry_after_ms"] / 1000 + 0.05, lambda: None)
        try:
            await alice.sync()
        except ApiError as e:  # pragma: no cover - shows the failure
            self.fail(f"sync after waiting retry_after_ms refused: {e}")
