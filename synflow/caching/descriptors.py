"""``@cached``: per-process caching of storage reads.

A store method decorated with :func:`cached` keeps, per store object, a
bounded LRU (:class:`~synflow.caching.local.LruCache`) keyed by its
arguments. Calling it returns a Deferred:

* a local hit fires at once with the cached value;
* a miss starts one read -- through the shared tier when the method says
  ``tier=True`` and the process has one, else straight to the database --
  and every concurrent caller of the same key waits for that one read;
* a failed read is not cached, and every waiter gets the failure;
* an invalidation (or a ``prefill``) that arrives while a read of the key
  is in flight stops that read's result from being cached; it is still
  returned to the callers that were waiting for it.

The bound method exposes ``invalidate(key)``, ``invalidate_all()``,
``prefill(key, value)`` and ``cache`` (the LRU). A
:class:`~synflow.caching.registry.CacheRegistry` finds the cached methods of
a store and applies caches-stream invalidations to them; registering also
sets each cache's size from the config and connects it to the shared tier.

Cached values are shared between callers: treat them as immutable.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import enum
import inspect
import logging
import math
import time
from collections.abc import Callable, Hashable
from typing import Any, Final, overload

import attrs
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.python.failure import Failure

from synflow.caching import stats
from synflow.caching.local import TOMBSTONE_CAPACITY, LruCache, Tombstones
from synflow.caching.tier import TierClient
from synflow.metrics import series

logger = logging.getLogger(__name__)
_tier_reads, _tier_fills = series(stats.TIER_READS), series(stats.TIER_FILLS)

#: A cache's size when neither the config nor the decorator gives one
#: (the same as ``CacheConfig.default_size``).
DEFAULT_MAX_ENTRIES: Final = 10_000

_NOTHING: Final[Any] = object()


class KeyedBy(enum.Enum):
    """What a cache's single argument is, for batched invalidations (see the registry)."""

    OTHER = "other"
    ROOM = "room"  # keyed by (room_id,): cleared by a room's current-state change
    USER = "user"  # keyed by (user_id,): cleared for each member in that change


@attrs.frozen
class CacheContext:
    """What a registry gives each of its caches.

    Attributes:
        tier: the shared tier, or None when this process has none.
        position_source: returns the process's caches-stream position (the
            minimum over writers), read before each database read to go
            with the fill.
        seconds: the clock.
        fill_deadline_s: a read that took longer than this does not fill the
            tier (the tier keeps tombstones for ``tier_ttl_s``; see the docs).
        tombstone_capacity: how many keys' invalidation IDs to remember.
    """

    tier: TierClient | None = None
    position_source: Callable[[], int] | None = None
    seconds: Callable[[], float] = time.time
    fill_deadline_s: float = math.inf
    tombstone_capacity: int = TOMBSTONE_CAPACITY


class _Read:
    """One read in flight and the callers waiting for it."""

    __slots__ = ("stale", "waiters")

    def __init__(self) -> None:
        self.waiters: list[Deferred[Any]] = []
        self.stale = False

    def wait(self) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.waiters.append(d)
        return d

    def succeed(self, value: Any) -> None:
        for d in self.waiters:
            if not d.called:  # a caller may have cancelled its own Deferred
                d.callback(value)

    def fail(self, failure: Failure) -> None:
        for d in self.waiters:
            if not d.called:
                d.errback(failure)


class CachedDescriptor:
    """The class attribute made by :func:`cached`; see the module docstring.

    Raises:
        TypeError: the method takes keyword-only or variadic parameters, or
            is keyed by room or user but does not take exactly one argument.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        max_entries: int | None = None,
        tier: bool = False,
        keyed_by: KeyedBy = KeyedBy.OTHER,
    ) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.attr_name = fn.__name__
        self.max_entries = max_entries
        self.tier = tier
        self.keyed_by = keyed_by
        self.__doc__ = fn.__doc__
        self._sig = inspect.signature(fn)
        params = list(self._sig.parameters.values())
        allowed = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        if not params or any(p.kind not in allowed for p in params):
            raise TypeError(
                f"@cached {self.name}: the method must take self and positional parameters only "
                f"(no *args, **kwargs or keyword-only parameters), got {self._sig}"
            )
        self._nparams = len(params) - 1
        if keyed_by is not KeyedBy.OTHER and self._nparams != 1:
            raise TypeError(
                f"@cached {self.name}: a cache keyed by {keyed_by.value} must take exactly one "
                f"argument (the {keyed_by.value} ID), got {self._sig}"
            )
        if max_entries is not None and max_entries < 1:
            raise ValueError(f"@cached {self.name}: max_entries must be at least 1, got {max_entries}")

    def __set_name__(self, owner: type, attr_name: str) -> None:
        self.attr_name = attr_name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> CachedDescriptor: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> CachedMethod: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> CachedDescriptor | CachedMethod:
        if obj is None:
            return self
        method = CachedMethod(self, obj)
        # Later look-ups find the bound cache in the instance dict (this is a
        # non-data descriptor), so each store object has exactly one.
        obj.__dict__[self.attr_name] = method
        return method

    def key_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The cache key of a call: its arguments after self, in parameter order.

        Raises:
            TypeError: the arguments do not fit the method, or are not hashable.
        """
        if not kwargs and len(args) == self._nparams:
            key = args
        else:
            bound = self._sig.bind(None, *args, **kwargs)
            bound.apply_defaults()
            key = tuple(bound.arguments.values())[1:]
        try:
            hash(key)
        except TypeError:
            raise TypeError(
                f"@cached {self.name}: every argument must be hashable to form a cache key, got {key!r}"
            ) from None
        return key


class CachedMethod:
    """A ``@cached`` method bound to one store object, with its own LRU."""

    def __init__(self, descriptor: CachedDescriptor, obj: object) -> None:
        self.descriptor = descriptor
        self.name = descriptor.name
        self._obj = obj
        self._ctx = CacheContext()
        self._pending: dict[Hashable, _Read] = {}
        self._tombstones: Tombstones | None = None
        self._reported_size = 0
        self._hits = stats.HITS.labels(cache=self.name)
        self._misses = stats.MISSES.labels(cache=self.name)
        self._evictions = stats.EVICTIONS.labels(cache=self.name)
        self._invalidations = stats.INVALIDATIONS.labels(cache=self.name)
        self._size = stats.SIZE.labels(cache=self.name)
        self.cache = LruCache(descriptor.max_entries or DEFAULT_MAX_ENTRIES, on_evict=self._evictions.inc)
        self.__doc__ = descriptor.__doc__

    def __repr__(self) -> str:
        return f"<cached {self.name} of {type(self._obj).__name__}: {len(self.cache)} entries>"

    @property
    def uses_tier(self) -> bool:
        """Whether reads go through the shared tier (declared ``tier=True`` and the process has one)."""
        return self.descriptor.tier and self._ctx.tier is not None and self._ctx.position_source is not None

    def attach(self, ctx: CacheContext, max_entries: int) -> None:
        """Take the registry's context and size (evicting beyond the new size)."""
        self._ctx = ctx
        self.cache.resize(max_entries)
        if self.uses_tier and self._tombstones is None:
            self._tombstones = Tombstones(ctx.tombstone_capacity)
        self._report_size()

    # -- reading -----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Deferred[Any]:
        key = self.descriptor.key_for(args, kwargs)
        found, value = self.cache.lookup(key)
        if found:
            self._hits.inc()
            return succeed(value)
        read = self._pending.get(key)
        if read is not None:
            self._hits.inc()
            return read.wait()
        self._misses.inc()
        read = self._pending[key] = _Read()
        waiter = read.wait()
        d = Deferred.fromCoroutine(self._load(key, read))
        d.addCallbacks(self._loaded, self._failed, callbackArgs=(key, read), errbackArgs=(key, read))
        return waiter

    async def _load(self, key: tuple[Any, ...], read: _Read) -> Any:
        """Read one key: the tier first (if any), then the database, then fill the tier."""
        tier = self._ctx.tier if self.uses_tier else None
        if tier is None:
            return await self._call(key)
        value = await self._tier_lookup(tier, key)
        if value is not _NOTHING:
            return value
        position = self._position()
        started = self._ctx.seconds()
        value = await self._call(key)
        self._fill(tier, key, read, value, position, started)
        return value

    async def _call(self, key: tuple[Any, ...]) -> Any:
        result = self.descriptor.fn(self._obj, *key)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def _tier_lookup(self, tier: TierClient, key: tuple[Any, ...]) -> Any:
        """The tier's value for ``key`` if it can be trusted here, else ``_NOTHING``."""
        try:
            entry = await tier.lookup(self.name, key)
        except Exception as e:
            logger.warning("shared-tier look-up of %s%r failed; reading the database: %s", self.name, key, e)
            _tier_reads(self.name, "error").inc()
            return _NOTHING
        if entry is None:
            _tier_reads(self.name, "miss").inc()
            return _NOTHING
        value, filled_at = entry
        assert self._tombstones is not None
        if not self._tombstones.allows(key, filled_at):
            # The value may predate an invalidation we have already applied
            # and the invalidator has not: caching it would keep it stale.
            _tier_reads(self.name, "distrusted").inc()
            return _NOTHING
        _tier_reads(self.name, "hit").inc()
        return value

    def _position(self) -> int | None:
        assert self._ctx.position_source is not None
        try:
            return self._ctx.position_source()
        except Exception:
            logger.exception("caches position source failed; %s will not fill the tier", self.name)
            return None

    def _fill(self, tier: TierClient, key: tuple[Any, ...], read: _Read, value: Any,
              position: int | None, started: float) -> None:
        if read.stale or position is None or self._ctx.seconds() - started > self._ctx.fill_deadline_s:
            _tier_fills(self.name, "skipped").inc()
            return

        def done(stored: bool) -> None:
            _tier_fills(self.name, "stored" if stored else "refused").inc()

        def failed(f: Failure) -> None:
            _tier_fills(self.name, "error").inc()
            logger.warning("shared-tier fill of %s%r failed: %s", self.name, key, f.getErrorMessage())

        maybeDeferred(tier.fill, self.name, key, value, position).addCallbacks(done, failed)

    def _loaded(self, value: Any, key: Hashable, read: _Read) -> None:
        if self._pending.get(key) is read:
            del self._pending[key]
        if not read.stale:
            self.cache.set(key, value)
            self._report_size()
        read.succeed(value)

    def _failed(self, failure: Failure, key: Hashable, read: _Read) -> None:
        if self._pending.get(key) is read:
            del self._pending[key]
        read.fail(failure)

    # -- invalidating ------------------------------------------------------------------------------

    def invalidate(self, key: tuple[Any, ...], stream_id: int | None = None) -> None:
        """Drop ``key``, and keep any read of it now in flight out of the cache.

        Args:
            key: the key tuple (the call's arguments).
            stream_id: the caches-stream ID of the invalidation, when known;
                tier-backed caches use it to judge values read from the tier.
        """
        self.cache.pop(key)
        read = self._pending.pop(key, None)
        if read is not None:
            read.stale = True
        if self._tombstones is not None:
            self._tombstones.record(key, stream_id)
        self._invalidations.inc()
        self._report_size()

    def invalidate_all(self, stream_id: int | None = None) -> None:
        """Drop every entry, and keep every read now in flight out of the cache."""
        self.cache.clear()
        for read in self._pending.values():
            read.stale = True
        self._pending.clear()
        if self._tombstones is not None:
            self._tombstones.record_all(stream_id)
        self._invalidations.inc()
        self._report_size()

    def prefill(self, key: tuple[Any, ...], value: Any) -> None:
        """Store a value known to be current (e.g. just written); a read in flight
        for the key will not overwrite it."""
        hash(key)
        read = self._pending.pop(key, None)
        if read is not None:
            read.stale = True
        self.cache.set(key, value)
        self._report_size()

    def _report_size(self) -> None:
        size = len(self.cache)
        if size != self._reported_size:
            self._size.inc(size - self._reported_size)
            self._reported_size = size


@overload
def cached(name: Callable[..., Any]) -> CachedDescriptor: ...


@overload
def cached(
    name: str | None = None, *, max_entries: int | None = None, tier: bool = False,
    room_key: bool = False, user_key: bool = False,
) -> Callable[[Callable[..., Any]], CachedDescriptor]: ...


def cached(
    name: str | Callable[..., Any] | None = None,
    *,
    max_entries: int | None = None,
    tier: bool = False,
    room_key: bool = False,
    user_key: bool = False,
) -> CachedDescriptor | Callable[[Callable[..., Any]], CachedDescriptor]:
    """Cache a store method's results per store object; see the module docstring.

    Usable bare (``@cached``) or with arguments (``@cached(tier=True)``).

    Args:
        name: the cache name on the caches stream (default: the method name).
        max_entries: the LRU bound, unless ``caches.sizes`` names this cache
            (default ``caches.default_size``).
        tier: read through the shared tier when the process has one. The
            values must survive a JSON round trip (tuples come back as lists).
        room_key: the method takes one argument, a room ID; a room's
            current-state change (``cs_cache_fake``) invalidates it.
        user_key: the method takes one argument, a user ID; a current-state
            change invalidates it for every member it lists.

    Raises:
        TypeError: see :class:`CachedDescriptor`.
        ValueError: both ``room_key`` and ``user_key``, or a bad ``max_entries``.
    """
    if room_key and user_key:
        raise ValueError("a cache is keyed by room or by user, not both")
    keyed_by = KeyedBy.ROOM if room_key else KeyedBy.USER if user_key else KeyedBy.OTHER
    if callable(name):
        return CachedDescriptor(name)
    cache_name = name

    def decorate(fn: Callable[..., Any]) -> CachedDescriptor:
        return CachedDescriptor(fn, name=cache_name, max_entries=max_entries, tier=tier, keyed_by=keyed_by)

    return decorate
