"""Capped exponential backoff with jitter, as a pure value.

Used for replication reconnects, internal RPC retries and federation
destinations. Randomness is injected (a :class:`random.Random`), so tests
fix the seed and assert exact delays.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import random

import attrs


@attrs.frozen
class Backoff:
    """Delays that grow by ``multiplier`` from ``initial_s`` up to ``max_s``.

    Attributes:
        initial_s: the delay after the first failure.
        multiplier: growth per further failure (> 1).
        max_s: the cap; no delay exceeds it, jitter included.
        jitter: a fraction; each delay is scaled by a factor drawn uniformly
            from ``[1 - jitter, 1 + jitter]`` (then capped).
    """

    initial_s: float = 0.1
    multiplier: float = 2.0
    max_s: float = 5.0
    jitter: float = 0.1

    def __attrs_post_init__(self) -> None:
        if self.initial_s <= 0 or self.max_s < self.initial_s:
            raise ValueError(f"need 0 < initial_s <= max_s, got {self.initial_s} and {self.max_s}")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")

    def base_delay(self, failures: int) -> float:
        """The un-jittered delay after ``failures`` consecutive failures (>= 1)."""
        if failures < 1:
            return 0.0
        delay = self.initial_s
        for _ in range(failures - 1):
            delay *= self.multiplier
            if delay >= self.max_s:
                return self.max_s
        return min(delay, self.max_s)

    def delay(self, failures: int, rng: random.Random) -> float:
        """The jittered, capped delay after ``failures`` consecutive failures."""
        base = self.base_delay(failures)
        if self.jitter:
            base *= rng.uniform(1 - self.jitter, 1 + self.jitter)
        return min(base, self.max_s)
