"""The per-process building blocks of a cache: a bounded LRU and local tombstones.

:class:`LruCache` is the map each ``@cached`` method keeps per store object.
:class:`Tombstones` remembers, for a cache that reads through the shared
tier, the caches-stream ID of the latest invalidation this process applied
to each recently invalidated key, so that a value coming back from the tier
that predates one of those invalidations is not trusted (see
``docs/caching.md``, "Reading through the tier"). Both are plain data
structures: no reactor, no metrics.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Final

#: How many keys' invalidation IDs a tier-backed cache remembers by default.
TOMBSTONE_CAPACITY: Final = 10_000

_MISSING: Final[Any] = object()


class LruCache:
    """A map bounded to ``max_size`` entries that evicts the least recently used.

    Args:
        max_size: the bound (at least 1).
        on_evict: called with the number of entries evicted to keep the bound
            (not for explicit removals).

    Raises:
        ValueError: ``max_size`` is below 1.
    """

    def __init__(self, max_size: int, on_evict: Callable[[int], None] | None = None) -> None:
        self._check_size(max_size)
        self._max_size = max_size
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._on_evict = on_evict

    @staticmethod
    def _check_size(max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"a cache must hold at least 1 entry, got max_size={max_size}")

    @property
    def max_size(self) -> int:
        """The bound on the number of entries."""
        return self._max_size

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._data))

    def lookup(self, key: Hashable) -> tuple[bool, Any]:
        """``(True, value)`` and mark the entry most recently used, or ``(False, None)``."""
        value = self._data.get(key, _MISSING)
        if value is _MISSING:
            return False, None
        self._data.move_to_end(key)
        return True, value

    def peek(self, key: Hashable, default: Any = None) -> Any:
        """The value for ``key`` without touching its recency, or ``default``."""
        return self._data.get(key, default)

    def set(self, key: Hashable, value: Any) -> int:
        """Store ``value`` as the most recently used entry.

        Returns:
            How many entries were evicted to stay within the bound.
        """
        self._data[key] = value
        self._data.move_to_end(key)
        return self._shrink()

    def pop(self, key: Hashable) -> bool:
        """Remove ``key``; True if it was present."""
        return self._data.pop(key, _MISSING) is not _MISSING

    def clear(self) -> int:
        """Remove every entry; returns how many there were."""
        n = len(self._data)
        self._data.clear()
        return n

    def resize(self, max_size: int) -> int:
        """Change the bound, evicting the least recently used entries beyond it.

        Returns:
            How many entries were evicted.
        """
        self._check_size(max_size)
        self._max_size = max_size
        return self._shrink()

    def _shrink(self) -> int:
        evicted = 0
        while len(self._data) > self._max_size:
            self._data.popitem(last=False)
            evicted += 1
        if evicted and self._on_evict is not None:
            self._on_evict(evicted)
        return evicted


class Tombstones:
    """The latest invalidation ID this process applied, per recently invalidated key.

    A value read from the shared tier carries the caches-stream position its
    filler read at. :meth:`allows` says whether that value can be trusted
    here: not if this process has applied an invalidation of the key (or of
    the whole cache) with a higher ID, since the value may predate it while
    the invalidator has not yet deleted it from the tier. Trusting it would
    put a stale value in the local LRU with no invalidation left to remove it.

    Memory is bounded: when more than ``capacity`` keys are remembered, the
    oldest is forgotten and its ID raises a per-cache *floor* below which no
    tier value is trusted -- conservative, never unsafe. An invalidation whose
    ID is unknown (applied by hand, without a stream ID) makes the key, or
    the whole cache, untrusted until an invalidation with a known ID arrives.

    Args:
        capacity: how many keys to remember individually.
    """

    def __init__(self, capacity: int = TOMBSTONE_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"tombstone capacity must be at least 1, got {capacity}")
        self._capacity = capacity
        # key -> (highest known ID, an invalidation of unknown ID is pending)
        self._keys: OrderedDict[Hashable, tuple[int, bool]] = OrderedDict()
        self._floor = 0
        self._all_unknown = False

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def floor(self) -> int:
        """No tier value filled below this position is trusted."""
        return self._floor

    def record(self, key: Hashable, stream_id: int | None) -> None:
        """Note an invalidation of ``key`` at ``stream_id`` (None: ID unknown)."""
        known, _unknown = self._keys.pop(key, (0, False))
        if stream_id is None:
            self._keys[key] = (known, True)
        else:
            self._keys[key] = (max(known, stream_id), False)
        while len(self._keys) > self._capacity:
            _old, (old_id, _) = self._keys.popitem(last=False)
            self._floor = max(self._floor, old_id)

    def record_all(self, stream_id: int | None) -> None:
        """Note an invalidation of the whole cache at ``stream_id`` (None: ID unknown)."""
        if stream_id is None:
            self._all_unknown = True
            return
        self._all_unknown = False
        self._floor = max(self._floor, stream_id)
        for key in [k for k, (i, unknown) in self._keys.items() if i <= self._floor and not unknown]:
            del self._keys[key]

    def allows(self, key: Hashable, fill_position: int) -> bool:
        """Whether a tier value for ``key`` filled at ``fill_position`` is at least as new
        as every invalidation of it this process has applied."""
        if self._all_unknown or fill_position < self._floor:
            return False
        entry = self._keys.get(key)
        if entry is None:
            return True
        known, unknown = entry
        return not unknown and fill_position >= known
