"""The key ring: pinned keys, fetched keys cached until valid_until_ts, bounded refetching."""

from __future__ import annotations

from signedjson.key import encode_verify_key_base64, generate_signing_key, get_verify_key
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from synflow.federation.keyring import REFETCH_INTERVAL_MS, KeyRing, KeyUnavailable, pinned_keys
from synflow.federation.keys import KEY_VALIDITY_MS, server_keys_response

KEY = generate_signing_key("a_1")


class Fetcher:
    """Answers key fetches with a.test's response (or a scripted one) and counts them."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.calls: list[str] = []
        self.answer = None
        self.held: list[Deferred] = []
        self.hold = False

    def __call__(self, server: str) -> Deferred:
        self.calls.append(server)
        if self.hold:
            d: Deferred = Deferred()
            self.held.append(d)
            return d
        if self.answer is not None:
            return self.answer
        return succeed(server_keys_response(server, KEY, int(self.clock.seconds() * 1000)))


class KeyRingTest(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.fetch = Fetcher(self.clock)

    def lookup(self, ring: KeyRing, server: str = "a.test", kid: str = "ed25519:a_1"):
        return Deferred.fromCoroutine(ring.verify_key(server, kid))

    def test_fetched_once_and_cached_until_valid_until(self):
        """A fetched key is reused until its valid_until_ts, then fetched again."""
        ring = KeyRing(self.fetch, self.clock)
        key = self.successResultOf(self.lookup(ring))
        self.assertEqual(key.encode(), KEY.verify_key.encode())
        self.clock.advance(KEY_VALIDITY_MS / 1000 - 1)
        self.successResultOf(self.lookup(ring))
        self.assertEqual(self.fetch.calls, ["a.test"])
        self.clock.advance(1)
        self.successResultOf(self.lookup(ring))
        self.assertEqual(self.fetch.calls, ["a.test", "a.test"])

    def test_pinned_keys_are_never_fetched(self):
        """A server in trusted_keys uses only its pinned keys; another key ID is unavailable, nothing fetched."""
        pinned = pinned_keys({"a.test": {"ed25519:a_1": encode_verify_key_base64(get_verify_key(KEY))}})
        ring = KeyRing(self.fetch, self.clock, pinned)
        self.assertEqual(self.successResultOf(self.lookup(ring)).encode(), KEY.verify_key.encode())
        self.failureResultOf(self.lookup(ring, kid="ed25519:other"), KeyUnavailable)
        self.assertEqual(self.fetch.calls, [])

    def test_pinned_keys_must_decode(self):
        """A pinned key that is not 32 bytes of base64 is a ValueError naming the server."""
        with self.assertRaisesRegex(ValueError, "a.test"):
            pinned_keys({"a.test": {"ed25519:a_1": "AAAA"}})

    def test_concurrent_lookups_share_one_fetch(self):
        """Lookups made while a fetch is running wait for it instead of fetching again."""
        self.fetch.hold = True
        ring = KeyRing(self.fetch, self.clock)
        first, second = self.lookup(ring), self.lookup(ring)
        self.assertEqual(len(self.fetch.calls), 1)
        self.fetch.held[0].callback(server_keys_response("a.test", KEY, int(self.clock.seconds() * 1000)))
        self.successResultOf(first)
        self.successResultOf(second)

    def test_failures_and_unknown_key_ids_are_not_refetched_at_once(self):
        """A failed fetch, or a key ID the fresh keys lack, fetches again only after REFETCH_INTERVAL_MS."""
        self.fetch.answer = fail(ConnectionRefusedError())
        ring = KeyRing(self.fetch, self.clock)
        self.failureResultOf(self.lookup(ring), KeyUnavailable)
        self.failureResultOf(self.lookup(ring), KeyUnavailable)
        self.assertEqual(len(self.fetch.calls), 1)
        self.fetch.answer = None
        self.clock.advance(REFETCH_INTERVAL_MS / 1000)
        self.successResultOf(self.lookup(ring))
        for _ in range(10):
            self.failureResultOf(self.lookup(ring, kid="ed25519:forged"), KeyUnavailable)
        self.assertEqual(len(self.fetch.calls), 2)

    def test_forged_key_response_refused(self):
        """A key response for a.test signed by another key is refused; nothing is cached."""
        forged = server_keys_response("a.test", generate_signing_key("a_1"), int(self.clock.seconds() * 1000))
        forged["verify_keys"] = server_keys_response("a.test", KEY, 0)["verify_keys"]
        self.fetch.answer = succeed(forged)
        ring = KeyRing(self.fetch, self.clock)
        self.failureResultOf(self.lookup(ring), KeyUnavailable)
