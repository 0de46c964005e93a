"""The cache invalidator's side of the shared tier: caches-stream rows -> tier tombstones.

Each ``cache_invalidator`` instance follows the caches stream of every
writer (its replication handler calls :meth:`TierInvalidator.row_handler`)
and applies to the tier the invalidations of the keys it owns:
:func:`owns_key` shards ``"<cache>:<json key>"`` over
``caches.cache_invalidator_instances``; whole-cache (``null`` key)
invalidations are applied by every instance. Batched names are expanded
with the process's :class:`~synflow.caching.registry.CacheRegistry` (the
invalidator registers the store classes to learn which caches are keyed by
room or user); declared caches without ``tier=True`` are skipped.

Tier invalidations commute (each raises a tombstone to a maximum), so they
run concurrently and out of order. One that fails is retried, with backoff,
until it succeeds; retries of one key coalesce at the highest position. The
backlog is bounded: when it overflows, the cache with the most pending keys
becomes a single whole-cache invalidation at the highest of their
positions, which covers them all.

Floors (see :mod:`synflow.caching.tier`): on start the invalidator raises
its floor to ``start_position()`` -- an ID at or above every invalidation it
may have missed while down, e.g. the highest caches-stream ID allocated so
far -- and every ``floor_interval_s`` it rewrites its floor, at the highest
ID it has seen, if Redis lost it.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final

from twisted.application.service import Service
from twisted.internet.defer import Deferred, gatherResults, maybeDeferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

from synflow.backoff import Backoff
from synflow.caching import stats
from synflow.caching.registry import CacheRegistry
from synflow.caching.tier import TierClient, encode_key, key_owner
from synflow.streams import CachesRow

logger = logging.getLogger(__name__)

#: Tier invalidations waiting (or being retried) before the backlog collapses.
MAX_PENDING: Final = 100_000

#: Tier invalidations in flight at once.
MAX_CONCURRENT: Final = 32

#: How often the invalidator checks that Redis still has its floor (seconds).
FLOOR_INTERVAL_S: Final = 1.0

Key = tuple[Any, ...]


def owns_key(instance: str, cache_name: str, key: Sequence[Any] | None, instances: Sequence[str]) -> bool:
    """Whether invalidator ``instance`` applies invalidations of this key to the tier.

    Args:
        instance: the invalidator's instance name.
        cache_name: the cache.
        key: the key tuple, or None for the whole cache (owned by every instance).
        instances: ``caches.cache_invalidator_instances``, in order.
    """
    if key is None:
        return instance in instances
    return key_owner(cache_name, key, instances) == instance


class TierInvalidator(Service):
    """Applies the caches stream to the shared tier, for the keys this instance owns.

    Args:
        tier: the shared tier.
        registry: declares the caches (for batched names and ``tier=True``).
        instance_name: this invalidator.
        instances: ``caches.cache_invalidator_instances``.
        clock: schedules retries and floor checks.
        start_position: returns a caches-stream ID at or above every
            invalidation this invalidator may have missed while it was down
            -- simplest, the highest ID allocated so far, read from the
            database at start-up; read once, in ``startService``.
        backoff: retry delays after failures.
        rng: jitter for the backoff.
        max_pending: the bound on the backlog.
        concurrency: tier requests in flight at once.
        floor_interval_s: how often to check the floor.
    """

    def __init__(
        self,
        tier: TierClient,
        registry: CacheRegistry,
        instance_name: str,
        instances: Sequence[str],
        clock: IReactorTime,
        *,
        start_position: Callable[[], int] = lambda: 0,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
        max_pending: int = MAX_PENDING,
        concurrency: int = MAX_CONCURRENT,
        floor_interval_s: float = FLOOR_INTERVAL_S,
    ) -> None:
        if instance_name not in instances:
            raise ValueError(f"{instance_name!r} is not in caches.cache_invalidator_instances {list(instances)}")
        self.tier = tier
        self.registry = registry
        self.instance_name = instance_name
        self.instances = list(instances)
        self.clock = clock
        self._start_position = start_position
        self._backoff = backoff or Backoff(initial_s=0.1, multiplier=2.0, max_s=5.0, jitter=0.1)
        self._rng = rng or random.Random()
        self._max_pending = max_pending
        self._concurrency = concurrency
        self._floor_interval_s = floor_interval_s
        self._pending: OrderedDict[tuple[str, str], tuple[str, Key | None, int]] = OrderedDict()
        self._in_flight: set[Deferred[Any]] = set()
        self._failures = 0
        self._retry_call: IDelayedCall | None = None
        self._floor_call: IDelayedCall | None = None
        self._floor_position = 0
        self._floor_raised = False
        self._pumping = False
        self._blocked = False
        self.max_seen = 0
        self.applied = 0

    # -- Service -----------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._floor_position = max(self._floor_position, self._start_position())
        self._blocked = False
        self._check_floor()
        self._pump()

    def stopService(self) -> Deferred[Any]:
        super().stopService()
        for call in (self._retry_call, self._floor_call):
            if call is not None and call.active():
                call.cancel()
        self._retry_call = self._floor_call = None
        if self._pending:
            # Not lost for good: the next start raises the floor over them.
            logger.info("stopping with %d tier invalidations not applied", len(self._pending))
        if not self._in_flight:
            return succeed(None)
        return gatherResults(list(self._in_flight), consumeErrors=True).addBoth(lambda _: None)

    # -- input -----------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Tier invalidations queued or awaiting a retry."""
        return len(self._pending)

    def row_handler(self, instance: str, token: int, rows: list[Any]) -> None:
        """The replication handler's row handler for the caches stream."""
        self.max_seen = max(self.max_seen, token)
        for row in rows:
            if isinstance(row, CachesRow):
                self.apply_row(row, token)
        self._pump()

    def apply_row(self, row: CachesRow, stream_id: int) -> None:
        """Queue the tier invalidations of one row this instance owns (call ``row_handler`` normally)."""
        self.max_seen = max(self.max_seen, stream_id)
        for name, key in self.registry.expand(row):
            if self.registry.uses_tier(name) and owns_key(self.instance_name, name, key, self.instances):
                self._enqueue(name, key, stream_id)
        self._pump()

    def _enqueue(self, name: str, key: Key | None, position: int) -> None:
        ident = (name, encode_key(key))
        old = self._pending.get(ident)
        if old is None and len(self._pending) >= self._max_pending:
            self._collapse()
            old = self._pending.get(ident)
        self._pending[ident] = (name, key, max(position, old[2]) if old else position)
        stats.INVALIDATOR_PENDING.set(len(self._pending))

    def _collapse(self) -> None:
        """Turn the pending keys of the busiest cache into one whole-cache invalidation."""
        per_cache = Counter(name for (name, k) in self._pending if k != "null")
        if not per_cache:
            return
        name = per_cache.most_common(1)[0][0]
        idents = [i for i in self._pending if i[0] == name]
        top = max(self._pending[i][2] for i in idents)
        for i in idents:
            del self._pending[i]
        self._pending[(name, "null")] = (name, None, top)
        stats.INVALIDATOR_OVERFLOWS.inc()
        logger.warning("tier invalidation backlog full: invalidating all of %s at %d instead of %d keys",
                       name, top, len(idents))

    # -- applying -----------------------------------------------------------------------------

    def _pump(self) -> None:
        if self._pumping:  # a request that completed synchronously; the loop below goes on
            return
        self._pumping = True
        try:
            while (self._pending and len(self._in_flight) < self._concurrency
                   and self._retry_call is None and not self._blocked):
                _ident, (name, key, position) = self._pending.popitem(last=False)
                d = maybeDeferred(self.tier.invalidate, name, key, position)
                self._in_flight.add(d)
                d.addBoth(self._done, d, name, key, position)
        finally:
            self._pumping = False
        stats.INVALIDATOR_PENDING.set(len(self._pending))

    def _done(self, result: Any, d: Deferred[Any], name: str, key: Key | None, position: int) -> None:
        self._in_flight.discard(d)
        if isinstance(result, Failure):
            stats.TIER_INVALIDATIONS.labels(result="error").inc()
            self._failures += 1
            if self._failures == 1:
                logger.warning("tier invalidation of %s %s failed (will retry): %s",
                               name, encode_key(key), result.getErrorMessage())
            self._enqueue(name, key, position)
            if not self.running:
                self._blocked = True  # until startService
            elif self._retry_call is None:
                delay = self._backoff.delay(self._failures, self._rng)
                self._retry_call = self.clock.callLater(delay, self._retry)
            return
        stats.TIER_INVALIDATIONS.labels(result="applied").inc()
        self.applied += 1
        if self._failures:
            logger.info("tier invalidations succeed again after %d failures", self._failures)
        self._failures = 0
        self._pump()

    def _retry(self) -> None:
        self._retry_call = None
        self._pump()

    # -- floors -------------------------------------------------------------------------------

    def _check_floor(self) -> None:
        """Raise the floor once after starting; from then on, rewrite it if Redis lost it."""
        self._floor_call = None
        position = max(self._floor_position, self.max_seen)
        if not self._floor_raised:
            d = maybeDeferred(self.tier.raise_floor, self.instance_name, position)
        else:
            d = maybeDeferred(self.tier.ensure_floor, self.instance_name, position)
        d.addCallbacks(self._floor_written, self._floor_failed, callbackArgs=(position,))
        d.addBoth(self._schedule_floor_check)

    def _floor_written(self, wrote: bool, position: int) -> None:
        if wrote and self._floor_raised:
            logger.warning("the tier had no floor for %s (Redis lost its data?): wrote %d",
                           self.instance_name, position)
        elif wrote:
            logger.info("raised the tier floor of %s to %d", self.instance_name, position)
        self._floor_raised = True

    def _floor_failed(self, failure: Failure) -> None:
        # Expected once or twice at start-up, while the tier connects.
        log = logger.warning if self._floor_raised else logger.info
        log("could not write the tier floor of %s (will retry): %s", self.instance_name, failure.getErrorMessage())

    def _schedule_floor_check(self, _: Any) -> None:
        if self.running and self._floor_call is None:
            self._floor_call = self.clock.callLater(self._floor_interval_s, self._check_floor)
