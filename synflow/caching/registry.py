"""The cache registry: a process's ``@cached`` methods, and invalidations applied to them.

A process builds one :class:`CacheRegistry` from its ``caches:`` config and
registers its store objects with it; the registry finds each store's
``@cached`` methods, sizes them (``caches.sizes[name]``, else the
decorator's ``max_entries``, else ``caches.default_size``) and connects them
to the shared tier when the process has one.

Invalidations arrive as caches-stream rows (:class:`~synflow.streams.CachesRow`)
from every writer, in any order. :meth:`CacheRegistry.apply` handles each:

* ``[name, [k1, k2], ts]`` drops key ``(k1, k2)`` from every cache called
  ``name``; ``[name, null, ts]`` clears those caches;
* names this process has no cache for are ignored (and counted);
* the batched name :data:`CURRENT_STATE_CACHE_NAME` (``cs_cache_fake``),
  with keys ``[room_id, member, ...]``, drops ``(room_id,)`` from every
  cache declared ``@cached(room_key=True)`` and ``(member,)`` from every
  cache declared ``@cached(user_key=True)``.

Invalidations only remove, so they commute and are idempotent: any
interleaving of several writers' rows leaves the same caches.

Writers build the rows a write must record with :func:`invalidation_rows`
and, after commit, apply them to their own process with
:meth:`CacheRegistry.apply_local` (or :meth:`~CacheRegistry.invalidate_local`).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from twisted.internet.interfaces import IReactorTime

from synflow.caching import stats
from synflow.caching.descriptors import CacheContext, CachedDescriptor, CachedMethod, KeyedBy
from synflow.caching.local import TOMBSTONE_CAPACITY
from synflow.caching.tier import TierClient, encode_key
from synflow.config import CacheConfig
from synflow.errors import ConfigError
from synflow.limits import MAX_LINE_LENGTH
from synflow.streams import CachesRow, EventsRow

logger = logging.getLogger(__name__)

#: The batched name for a room's current-state change; keys ``[room_id, *members]``.
CURRENT_STATE_CACHE_NAME: Final = "cs_cache_fake"

#: Names that expand to several caches on the receiving side.
BATCHED_NAMES: Final = frozenset({CURRENT_STATE_CACHE_NAME})

#: Members listed per ``cs_cache_fake`` row: 50 user IDs of up to 255
#: characters stay well inside one replication line.
MEMBERS_PER_ROW: Final = 50

#: The largest caches row (as JSON) a writer may record: the replication line
#: limit less room for ``RDATA caches <instance> <token> ``.
MAX_ROW_BYTES: Final = MAX_LINE_LENGTH - 1024

Key = tuple[Any, ...]


def freeze_key(keys: Sequence[Any]) -> Key:
    """A key tuple from wire keys: nested JSON arrays become tuples, so it is hashable."""
    return tuple(freeze_key(k) if isinstance(k, list | tuple) else k for k in keys)


class CacheRegistry:
    """The ``@cached`` methods of one process's stores, and how invalidations reach them.

    Args:
        config: the ``caches:`` section.
        tier: the shared tier (see :func:`synflow.caching.tier.open_tier`);
            None: caches are local only.
        position_source: returns this process's caches-stream position, the
            minimum over every writer's position (required with a tier).
        clock: for the invalidation-lag metric and read durations
            (default: the wall clock).
        tombstone_capacity: keys whose invalidation IDs each tier-backed
            cache remembers.

    Raises:
        ConfigError: a tier without a position source.
    """

    def __init__(
        self,
        config: CacheConfig,
        *,
        tier: TierClient | None = None,
        position_source: Callable[[], int] | None = None,
        clock: IReactorTime | None = None,
        tombstone_capacity: int = TOMBSTONE_CAPACITY,
    ) -> None:
        if tier is not None and position_source is None:
            raise ConfigError("a shared cache tier needs the caches-stream position source", key="caches.tier")
        self.config = config
        self._seconds: Callable[[], float] = clock.seconds if clock is not None else time.time
        self.context = CacheContext(
            tier=tier,
            position_source=position_source,
            seconds=self._seconds,
            fill_deadline_s=config.tier_ttl_s / 2,
            tombstone_capacity=tombstone_capacity,
        )
        self._descriptors: dict[str, CachedDescriptor] = {}
        self._caches: dict[str, list[CachedMethod]] = {}

    # -- registration ------------------------------------------------------------------------

    def register(self, store: object) -> list[str]:
        """Find and attach the ``@cached`` methods of ``store``.

        A class (rather than an object) only declares its caches: enough for
        the cache invalidator, which expands batched names and holds no
        caches itself. Registering the same store twice changes nothing.

        Returns:
            The cache names found.

        Raises:
            ValueError: a cache name is already declared by a different method.
        """
        names = []
        for attr, descriptor in _cached_attributes(store if isinstance(store, type) else type(store)):
            self._declare(descriptor)
            names.append(descriptor.name)
            if isinstance(store, type):
                continue
            method = getattr(store, attr)
            assert isinstance(method, CachedMethod)
            bound = self._caches.setdefault(descriptor.name, [])
            if any(m is method for m in bound):
                continue
            method.attach(self.context, self.size_for(descriptor))
            bound.append(method)
        return names

    def _declare(self, descriptor: CachedDescriptor) -> None:
        known = self._descriptors.get(descriptor.name)
        if known is not None and known is not descriptor:
            raise ValueError(
                f"cache name {descriptor.name!r} is declared by both {known.fn.__qualname__} and "
                f"{descriptor.fn.__qualname__}: give one of them another name= so that "
                "invalidations reach the right cache"
            )
        if descriptor.name in BATCHED_NAMES:
            raise ValueError(f"{descriptor.name!r} is a batched invalidation name, not a cache name")
        self._descriptors[descriptor.name] = descriptor

    def size_for(self, descriptor: CachedDescriptor) -> int:
        """A cache's size: ``caches.sizes[name]``, else ``max_entries``, else ``default_size``."""
        size = self.config.sizes.get(descriptor.name)
        if size is None:
            size = descriptor.max_entries or self.config.default_size
        return size

    @property
    def names(self) -> list[str]:
        """Every declared cache name, sorted."""
        return sorted(self._descriptors)

    def caches(self, name: str) -> list[CachedMethod]:
        """The bound caches called ``name`` (one per registered store object)."""
        return list(self._caches.get(name, ()))

    def uses_tier(self, name: str) -> bool:
        """Whether ``name`` may be in the shared tier (declared ``tier=True``, or unknown here)."""
        descriptor = self._descriptors.get(name)
        return descriptor is None or descriptor.tier

    def _keyed_by(self, kind: KeyedBy) -> list[str]:
        return sorted(n for n, d in self._descriptors.items() if d.keyed_by is kind)

    # -- invalidation --------------------------------------------------------------------------

    def expand(self, row: CachesRow) -> list[tuple[str, Key | None]]:
        """The ``(cache name, key or None)`` pairs one row invalidates."""
        if row.cache_name != CURRENT_STATE_CACHE_NAME:
            return [(row.cache_name, None if row.keys is None else freeze_key(row.keys))]
        room_caches, user_caches = self._keyed_by(KeyedBy.ROOM), self._keyed_by(KeyedBy.USER)
        if row.keys is None:
            # Writers never send this; clearing everything it could mean is safe.
            logger.warning("%s row with null keys: clearing every room- and user-keyed cache", row.cache_name)
            return [(n, None) for n in room_caches + user_caches]
        if not row.keys:
            logger.warning("ignoring %s row without a room ID", row.cache_name)
            return []
        frozen = freeze_key(row.keys)
        room_id, members = frozen[0], frozen[1:]
        pairs: list[tuple[str, Key | None]] = [(n, (room_id,)) for n in room_caches]
        pairs.extend((n, (m,)) for n in user_caches for m in members)
        return pairs

    def apply(self, rows: Iterable[CachesRow], stream_id: int | None = None) -> None:
        """Apply caches-stream rows from any writer, observing the invalidation lag.

        Args:
            rows: the rows (of one stream ID, or several).
            stream_id: their caches-stream ID when known (the RDATA token);
                tier-backed caches use it to judge values read from the tier.
        """
        now = self._seconds()
        for row in rows:
            stats.INVALIDATION_LAG.observe(max(0.0, now - row.invalidation_ts / 1000))
            self._apply_row(row, stream_id)

    def row_handler(self, instance: str, token: int, rows: list[Any]) -> None:
        """The replication handler's row-handler signature for the caches stream."""
        self.apply(rows, token)

    def events_row_handler(self, instance: str, token: int, rows: list[Any]) -> None:
        """The events stream's row handler: a state event invalidates its room's caches at once.

        The persister records the same change on the caches stream, but the
        two streams advance independently: this process may pass the event's
        events position before the caches row arrives. Dropping the entries
        here, before the events position advances, means no read at that
        position sees the room's old state. A membership event also drops
        its member's user-keyed entries. The caches-stream ID is not known
        here, so tier-backed caches distrust tier values of these keys until
        an invalidation with a known ID arrives (see ``docs/caching.md``).
        """
        for row in rows:
            if not isinstance(row, EventsRow) or row.state_key is None:
                continue
            keys = [row.room_id, row.state_key] if row.is_membership else [row.room_id]
            self.invalidate_local(CURRENT_STATE_CACHE_NAME, keys)

    def apply_local(self, rows: Iterable[CachesRow], stream_id: int | None = None) -> None:
        """Apply this process's own rows right after the writing transaction commits."""
        for row in rows:
            self._apply_row(row, stream_id)

    def invalidate_local(self, cache_name: str, keys: Sequence[Any] | None, stream_id: int | None = None) -> None:
        """Invalidate one cache (or batched name) in this process only, e.g. after a commit."""
        self._apply_row(CachesRow(cache_name, None if keys is None else tuple(keys), 0), stream_id)

    def _apply_row(self, row: CachesRow, stream_id: int | None) -> None:
        for name, key in self.expand(row):
            caches = self._caches.get(name)
            if not caches:
                if name not in self._descriptors:
                    stats.UNKNOWN_INVALIDATIONS.inc()
                continue
            for cache in caches:
                if key is None:
                    cache.invalidate_all(stream_id)
                else:
                    cache.invalidate(key, stream_id)


def _cached_attributes(cls: type) -> list[tuple[str, CachedDescriptor]]:
    """``(attribute, descriptor)`` for each ``@cached`` method of ``cls``, subclasses first."""
    found: dict[str, CachedDescriptor] = {}
    for klass in cls.__mro__:
        for attr, value in vars(klass).items():
            if attr not in found and isinstance(value, CachedDescriptor):
                found[attr] = value
    return sorted(found.items())


def invalidation_rows(
    now_ms: int,
    entries: Iterable[tuple[str, Sequence[Any] | None]] = (),
    *,
    current_state: Mapping[str, Sequence[str]] | None = None,
) -> list[CachesRow]:
    """The caches rows a write must record in its transaction.

    Args:
        now_ms: the invalidation time (ms since the epoch).
        entries: ``(cache name, key tuple or None for the whole cache)``.
        current_state: room ID -> the members whose membership changed, for
            each room whose current state changed; becomes
            ``cs_cache_fake`` rows of at most :data:`MEMBERS_PER_ROW` members.

    Returns:
        The rows, in order, without duplicates.

    Raises:
        ValueError: a batched name among ``entries``, a key that is not JSON,
            or a row too long for one replication line.
    """
    rows: list[CachesRow] = []
    for name, keys in entries:
        if name in BATCHED_NAMES:
            raise ValueError(f"{name!r} is batched: pass it as current_state={{room_id: members}}")
        rows.append(CachesRow(name, None if keys is None else tuple(keys), now_ms))
    for room_id, members in (current_state or {}).items():
        members = list(members)
        chunks = [members[i:i + MEMBERS_PER_ROW] for i in range(0, len(members), MEMBERS_PER_ROW)] or [[]]
        rows.extend(CachesRow(CURRENT_STATE_CACHE_NAME, (room_id, *chunk), now_ms) for chunk in chunks)
    unique: list[CachesRow] = []
    seen: set[tuple[str, str]] = set()
    for row in rows:
        try:
            ident = (row.cache_name, encode_key(row.keys))
            size = len(json.dumps(row.to_wire()).encode("utf-8"))
        except TypeError as e:
            raise ValueError(f"cache key of {row.cache_name} is not JSON: {row.keys!r} ({e})") from None
        if size > MAX_ROW_BYTES:
            raise ValueError(f"caches row for {row.cache_name} is {size} bytes, over the {MAX_ROW_BYTES} limit")
        if ident not in seen:
            seen.add(ident)
            unique.append(row)
    return unique
