"""Caching of storage reads: per-process ``@cached`` LRUs and the shared Redis tier.

* :mod:`~synflow.caching.descriptors` -- ``@cached`` for store methods.
* :mod:`~synflow.caching.registry` -- the per-process registry that applies
  caches-stream invalidations; ``invalidation_rows`` for writers.
* :mod:`~synflow.caching.tier` -- the shared tier (Redis, and an in-memory
  fake with the same semantics).
* :mod:`~synflow.caching.invalidator` -- the cache invalidator's side of the
  tier.
* :mod:`~synflow.caching.local` -- the LRU and local tombstones.
* :mod:`~synflow.caching.stats` -- the metrics.

``docs/caching.md`` explains how they fit together and why the tier's fill
rule keeps stale values out.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from synflow.caching.descriptors import CachedDescriptor, CachedMethod, KeyedBy, cached
from synflow.caching.invalidator import TierInvalidator, owns_key
from synflow.caching.registry import (
    CURRENT_STATE_CACHE_NAME,
    CacheRegistry,
    invalidation_rows,
)
from synflow.caching.tier import (
    CacheTier,
    FakeCacheTier,
    TierClient,
    TierUnavailable,
    open_tier,
    tier_prefix,
)

__all__ = [
    "CURRENT_STATE_CACHE_NAME",
    "CacheRegistry",
    "CacheTier",
    "CachedDescriptor",
    "CachedMethod",
    "FakeCacheTier",
    "KeyedBy",
    "TierClient",
    "TierInvalidator",
    "TierUnavailable",
    "cached",
    "invalidation_rows",
    "open_tier",
    "owns_key",
    "tier_prefix",
]
