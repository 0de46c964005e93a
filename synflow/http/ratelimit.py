"""Per-key token buckets for the client API's rate limits, with bounded memory.

A bucket per key (a user for writes, an access token for syncs) holds up to
``burst`` tokens and refills at ``rate_per_s``; an action takes one token.
A refused action learns how long until a token is there (``retry_after_s``),
which the API returns as ``retry_after_ms`` and a ``Retry-After`` header.

A bucket left alone long enough to refill completely is the same as no
bucket, so idle buckets are dropped (every :data:`PRUNE_INTERVAL_S` at most,
during an ``allow``); and at most :data:`MAX_BUCKETS` keys are kept: past
that, the buckets idle longest go first (a dropped bucket only forgets a
key's recent use, it never refuses anything).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from collections import OrderedDict

from twisted.internet.interfaces import IReactorTime

#: Idle buckets are looked for at most this often.
PRUNE_INTERVAL_S = 60.0
#: The most keys one limiter remembers (the least recently used go first past it).
MAX_BUCKETS = 100_000


class TokenBucket:
    """A per-key token bucket.

    Args:
        rate_per_s: tokens added per second.
        burst: the most tokens a bucket holds (its size).
        clock: the time source.
    """

    def __init__(self, rate_per_s: float, burst: int, clock: IReactorTime, *, max_buckets: int = MAX_BUCKETS) -> None:
        self.rate = rate_per_s
        self.burst = burst
        self.clock = clock
        self.max_buckets = max_buckets
        # key -> (tokens, last update); ordered by last use (oldest first).
        self._state: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._last_prune = clock.seconds()

    def __len__(self) -> int:
        return len(self._state)

    def allow(self, key: str) -> bool:
        """Whether one more action of ``key`` fits (taking a token if so)."""
        return self.take(key) == 0.0

    def take(self, key: str) -> float:
        """Take a token for ``key``: 0.0 if there was one, else the seconds until there is one."""
        now = self.clock.seconds()
        self._prune(now)
        tokens, last = self._state.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - last) * self.rate)
        if tokens < 1:
            self._state[key] = (tokens, now)
            return (1 - tokens) / self.rate
        self._state[key] = (tokens - 1, now)
        while len(self._state) > self.max_buckets:
            self._state.popitem(last=False)
        return 0.0

    def _prune(self, now: float) -> None:
        if now - self._last_prune < PRUNE_INTERVAL_S:
            return
        self._last_prune = now
        full_after = self.burst / self.rate  # a bucket idle this long is full again: forget it
        while self._state:
            key, (_, last) = next(iter(self._state.items()))
            if now - last < full_after:
                return
            del self._state[key]
