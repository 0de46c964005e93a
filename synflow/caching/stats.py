"""The Prometheus metrics of the caching layer, in one place.

Every per-cache series carries the label ``cache`` (the cache name). Counters
are exposed with Prometheus' ``_total`` suffix, e.g.
``synflow_cache_hits_total{cache="get_user"}``. See ``docs/caching.md`` for
what each one counts.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from typing import Final

from synflow.metrics import counter, gauge, histogram

HITS: Final = counter("synflow_cache_hits", "Cached reads answered locally (or joined to a read in flight)", ["cache"])
MISSES: Final = counter("synflow_cache_misses", "Cached reads that started a read (tier or database)", ["cache"])
EVICTIONS: Final = counter("synflow_cache_evictions", "Entries evicted to keep a cache within its size", ["cache"])
INVALIDATIONS: Final = counter(
    "synflow_cache_invalidations", "Invalidations applied to a local cache (a key or the whole cache)", ["cache"]
)
SIZE: Final = gauge("synflow_cache_size", "Entries held in a local cache (summed over store objects)", ["cache"])
UNKNOWN_INVALIDATIONS: Final = counter(
    "synflow_cache_unknown_invalidations", "Caches-stream rows naming a cache this process does not have"
)
INVALIDATION_LAG: Final = histogram(
    "synflow_cache_invalidation_lag_seconds",
    "Time from a write recording a cache invalidation to this process applying it",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
TIER_READS: Final = counter(
    "synflow_cache_tier_reads",
    "Shared-tier look-ups by result (hit, miss, distrusted, error)",
    ["cache", "result"],
)
TIER_FILLS: Final = counter(
    "synflow_cache_tier_fills",
    "Shared-tier fills by result (stored, refused, skipped, error)",
    ["cache", "result"],
)
TIER_INVALIDATIONS: Final = counter(
    "synflow_cache_tier_invalidations",
    "Invalidations the cache invalidator applied to the shared tier, by result (applied, error)",
    ["result"],
)
INVALIDATOR_PENDING: Final = gauge(
    "synflow_cache_invalidator_pending", "Tier invalidations waiting to be (re)tried by the cache invalidator"
)
INVALIDATOR_OVERFLOWS: Final = counter(
    "synflow_cache_invalidator_overflows",
    "Times the invalidator's backlog overflowed and a cache's key invalidations became one whole-cache invalidation",
)
