"""The shared cache tier: values in Redis that every process reads through.

Layout under a prefix ``P`` (each key holds one cache key's state):

=================================  ==============================================
``P:<cache>:<json key>``           hash: ``v`` the JSON value, ``p`` the position
                                   it was filled at, ``t`` the key's tombstone
``P:<cache>:all``                  the cache's whole-cache tombstone
``P:!floor:<invalidator>``         the invalidator's floor (no expiry)
=================================  ==============================================

``<json key>`` is the key tuple as a compact JSON array, e.g. ``["@u:hs"]``.

The rules (each one Lua script, so atomic):

* **fill(cache, key, value, position)** stores the value unless the key's
  tombstone, or the cache's, is above ``position``, or the owning
  invalidator's floor is missing or above it, or a value filled at a higher
  position is already there. ``position`` is the reader's caches-stream
  position (the minimum over writers) taken *before* its database read.
* **invalidate(cache, key, position)** -- the cache invalidator only -- sets
  the key's tombstone to ``max(old, position)`` and deletes the value;
  ``key=None`` raises the whole-cache tombstone instead, which hides every
  value filled below it (a look-up compares them) and refuses such fills, so
  clearing a cache is O(1). Entries and tombstones expire ``ttl_s`` after
  their last write, so a tombstone outlives every value filled before it.
* **floors**: each invalidator keeps a floor for the keys it owns; values
  filled below it are hidden and fills below it refused, and with no floor
  at all nothing is stored or read. An invalidator raises its floor to its
  start position as it starts (covering what it missed while down) and
  rewrites it if Redis lost its data (tombstones gone), so neither a
  restarted invalidator nor a restarted Redis lets a stale value in.

:class:`CacheTier` is the txredisapi client; :class:`FakeCacheTier` keeps the
same state in memory with the same semantics for in-process tests. See
``docs/caching.md`` for why the minimum position is the right fill position.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from synflow.config import CacheConfig
from synflow.errors import ConfigError, SynflowError
from synflow.json_encoding import compact_json
from synflow.redis_connect import redis_endpoint, redis_password
from synflow.sharding import shard_for

#: How long a tier request may take before the reader gives up and reads the
#: database (seconds).
TIER_TIMEOUT_S: Final = 2.0


class TierUnavailable(SynflowError):
    """The shared tier is not connected, or did not answer in time."""


def encode_key(key: Sequence[Any] | None) -> str:
    """The key tuple as compact JSON (``None`` -> ``"null"``).

    Raises:
        TypeError: an element is not JSON-serialisable.
    """
    if key is None:
        return "null"
    return json.dumps(list(key), separators=(",", ":"), sort_keys=True)


def key_owner(cache_name: str, key: Sequence[Any], invalidators: Sequence[str]) -> str | None:
    """The invalidator instance that owns one cache key, or None without invalidators."""
    if not invalidators:
        return None
    return shard_for(f"{cache_name}:{encode_key(key)}", invalidators)


def tier_prefix(server_name: str) -> str:
    """The default key prefix of a deployment's tier."""
    return f"synflow:{server_name}:cache"


class TierClient(Protocol):
    """What ``@cached`` and the invalidator need from a tier."""

    def get(self, name: str, key: Sequence[Any]) -> Deferred[tuple[bool, Any]]: ...

    def lookup(self, name: str, key: Sequence[Any]) -> Deferred[tuple[Any, int] | None]: ...

    def fill(self, name: str, key: Sequence[Any], value: Any, position: int) -> Deferred[bool]: ...

    def invalidate(self, name: str, key: Sequence[Any] | None, position: int) -> Deferred[None]: ...

    def ensure_floor(self, instance: str, position: int) -> Deferred[bool]: ...

    def raise_floor(self, instance: str, position: int) -> Deferred[bool]: ...

    def tombstone(self, name: str, key: Sequence[Any] | None) -> Deferred[int | None]: ...


# KEYS: entry, cache tombstone, owner's floor. ARGV: value, position, ttl ms.
FILL_SCRIPT: Final = """
local pos = tonumber(ARGV[2])
local floor = redis.call('GET', KEYS[3])
if not floor or tonumber(floor) > pos then return 0 end
local c = redis.call('GET', KEYS[2])
if c and tonumber(c) > pos then return 0 end
local e = redis.call('HMGET', KEYS[1], 't', 'p')
if e[1] and tonumber(e[1]) > pos then return 0 end
if e[2] and tonumber(e[2]) > pos then return 0 end
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'p', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS: entry (ARGV[3] == 'key') or cache tombstone. ARGV: position, ttl ms, kind.
INVALIDATE_SCRIPT: Final = """
local pos = tonumber(ARGV[1])
if ARGV[3] == 'key' then
  local t = redis.call('HGET', KEYS[1], 't')
  if not t or tonumber(t) < pos then redis.call('HSET', KEYS[1], 't', ARGV[1]) end
  redis.call('HDEL', KEYS[1], 'v', 'p')
else
  local c = redis.call('GET', KEYS[1])
  if not c or tonumber(c) < pos then redis.call('SET', KEYS[1], ARGV[1]) end
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: entry, cache tombstone, owner's floor. Returns {value, position} or nil.
LOOKUP_SCRIPT: Final = """
local e = redis.call('HMGET', KEYS[1], 'v', 'p')
if not e[1] then return false end
local pos = tonumber(e[2])
local floor = redis.call('GET', KEYS[3])
if not floor or pos < tonumber(floor) then return false end
local c = redis.call('GET', KEYS[2])
if c and pos < tonumber(c) then return false end
return e
"""

# KEYS: a floor. ARGV: position. Raises the floor to the position.
RAISE_FLOOR_SCRIPT: Final = """
local f = redis.call('GET', KEYS[1])
if f and tonumber(f) >= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""


class _Keys:
    """Redis key names under one prefix."""

    def __init__(self, prefix: str, invalidators: Sequence[str]) -> None:
        self.prefix = prefix
        self.invalidators = list(invalidators)

    def entry(self, name: str, key: Sequence[Any]) -> str:
        return f"{self.prefix}:{name}:{encode_key(key)}"

    def cache(self, name: str) -> str:
        return f"{self.prefix}:{name}:all"

    def floor(self, instance: str | None) -> str:
        # With no invalidator configured nothing would ever invalidate the
        # tier, so fills look for a floor nobody writes and are refused.
        return f"{self.prefix}:!floor:{instance if instance is not None else '!none'}"

    def owner_floor(self, name: str, key: Sequence[Any]) -> str:
        return self.floor(key_owner(name, key, self.invalidators))


class CacheTier:
    """The shared tier in Redis, through a txredisapi connection.

    Args:
        client: a txredisapi connection or lazy connection handler. It must
            be created with ``convertNumbers=False`` (or values that look like
            numbers come back converted).
        prefix: the key prefix (see :func:`tier_prefix`).
        ttl_s: how long entries and tombstones live after their last write.
        invalidators: ``caches.cache_invalidator_instances``, to find the
            floor that guards each key.
        clock: when given, requests time out after ``timeout_s``.
        timeout_s: see ``clock``.
        is_connected: when given and False, requests fail at once with
            :class:`TierUnavailable` instead of waiting for a connection.
    """

    def __init__(self, client: Any, prefix: str, ttl_s: float, *, invalidators: Sequence[str] = (),
                 clock: IReactorTime | None = None, timeout_s: float = TIER_TIMEOUT_S,
                 is_connected: Callable[[], bool] | None = None) -> None:
        if ttl_s <= 0:
            raise ValueError(f"the tier TTL must be positive, got {ttl_s}")
        self.client = client
        self.keys = _Keys(prefix, invalidators)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._clock = clock
        self._timeout_s = timeout_s
        self._is_connected = is_connected

    @property
    def connected(self) -> bool:
        """Whether requests can be sent now (always True without an ``is_connected``)."""
        return self._is_connected is None or self._is_connected()

    def _request(self, method: str, *args: Any, **kwargs: Any) -> Deferred[Any]:
        """Send one command, failing fast while disconnected and giving up after the timeout.

        Requests are never queued while Redis is away (a fill sent long after
        its read could outlive the tombstone meant to refuse it), and a
        timed-out request is abandoned, not cancelled: txredisapi's request
        Deferreds have no canceller, and a cancelled one that is still waiting
        for a connection would be fired a second time when it comes.
        """
        if not self.connected:
            return fail(TierUnavailable("the shared cache tier is not connected"))
        d = getattr(self.client, method)(*args, **kwargs)
        if self._clock is None:
            return d
        return _with_timeout(d, self._clock, self._timeout_s)

    def lookup(self, name: str, key: Sequence[Any]) -> Deferred[tuple[Any, int] | None]:
        """``(value, fill position)`` if the tier holds a visible value, else None."""
        keys = [self.keys.entry(name, key), self.keys.cache(name), self.keys.owner_floor(name, key)]
        d = self._request("eval", LOOKUP_SCRIPT, keys, [])

        def decode(reply: Any) -> tuple[Any, int] | None:
            if not reply:
                return None
            return json.loads(reply[0]), int(reply[1])

        return d.addCallback(decode)

    def get(self, name: str, key: Sequence[Any]) -> Deferred[tuple[bool, Any]]:
        """``(True, value)`` if the tier holds a visible value, else ``(False, None)``."""
        return self.lookup(name, key).addCallback(lambda e: (False, None) if e is None else (True, e[0]))

    def fill(self, name: str, key: Sequence[Any], value: Any, position: int) -> Deferred[bool]:
        """Store ``value`` read at caches position ``position``; False if refused.

        Raises:
            TypeError: the value or key is not JSON-serialisable.
        """
        encoded = compact_json(value)
        keys = [self.keys.entry(name, key), self.keys.cache(name), self.keys.owner_floor(name, key)]
        d = self._request("eval", FILL_SCRIPT, keys, [encoded, str(int(position)), str(self.ttl_ms)])
        return d.addCallback(lambda r: int(r) == 1)

    def invalidate(self, name: str, key: Sequence[Any] | None, position: int) -> Deferred[None]:
        """Tombstone one key (or, with ``key=None``, the whole cache) at ``position``."""
        if key is None:
            target, kind = self.keys.cache(name), "all"
        else:
            target, kind = self.keys.entry(name, key), "key"
        d = self._request("eval", INVALIDATE_SCRIPT, [target], [str(int(position)), str(self.ttl_ms), kind])
        return d.addCallback(lambda _: None)

    def ensure_floor(self, instance: str, position: int) -> Deferred[bool]:
        """Write ``instance``'s floor if Redis has none (it lost its data); True if written."""
        d = self._request("set", self.keys.floor(instance), str(int(position)), only_if_not_exists=True)
        return d.addCallback(lambda r: bool(r))

    def raise_floor(self, instance: str, position: int) -> Deferred[bool]:
        """Raise ``instance``'s floor to ``position``; True if it rose.

        Run by an invalidator as it starts: invalidations it missed while it
        was down are at or below the position it starts from, so hiding every
        value filled below it (for the keys it owns) forgets none of them.
        """
        d = self._request("eval", RAISE_FLOOR_SCRIPT, [self.keys.floor(instance)], [str(int(position))])
        return d.addCallback(lambda r: int(r) == 1)

    def tombstone(self, name: str, key: Sequence[Any] | None) -> Deferred[int | None]:
        """The key's tombstone (or the cache's, for ``key=None``), None if there is none."""
        if key is None:
            d = self._request("get", self.keys.cache(name))
        else:
            d = self._request("hget", self.keys.entry(name, key), "t")
        return d.addCallback(lambda r: None if r is None else int(r))

    def close(self) -> Deferred[Any]:
        """Disconnect the client, when it can be."""
        disconnect = getattr(self.client, "disconnect", None)
        return disconnect() if disconnect is not None else succeed(None)


def open_tier(reactor: Any, config: CacheConfig, prefix: str) -> CacheTier | None:
    """Connect to ``caches.tier`` (lazily, reconnecting); None when no tier is configured.

    Raises:
        ConfigError: a password or TLS file cannot be read.
    """
    cfg = config.tier
    if cfg is None:
        return None
    # The Redis driver is optional (the ``redis`` extra); config validation checks it is there.
    import txredisapi

    try:
        password = redis_password(cfg)
        endpoint = redis_endpoint(reactor, cfg)
    except OSError as e:
        raise ConfigError(f"cannot read a Redis TLS or password file: {e}", key="caches.tier") from None
    factory = txredisapi.RedisFactory(None, cfg.dbid or None, 1, isLazy=True, password=password,
                                      replyTimeout=TIER_TIMEOUT_S * 5, convertNumbers=False)
    factory.maxDelay = 5
    factory.deferred.addErrback(lambda f: None)  # each request fails or times out on its own
    factory.startConnecting(endpoint)
    return CacheTier(factory.handler, prefix, config.tier_ttl_s, invalidators=config.cache_invalidator_instances,
                     clock=reactor, is_connected=lambda: factory.size > 0)


def _with_timeout(d: Deferred[Any], clock: IReactorTime, timeout_s: float) -> Deferred[Any]:
    """A Deferred with ``d``'s result, or failing with TierUnavailable after ``timeout_s``."""
    out: Deferred[Any] = Deferred()

    def expire() -> None:
        if not out.called:
            out.errback(TierUnavailable(f"the shared cache tier did not answer within {timeout_s} s"))

    call = clock.callLater(timeout_s, expire)

    def done(result: Any) -> None:
        if call.active():
            call.cancel()
        if out.called:
            return None  # too late: the caller has moved on
        if isinstance(result, Failure):
            out.errback(result)
        else:
            out.callback(result)
        return None

    d.addBoth(done)
    return out


@attrs.define
class _Entry:
    value: str | None = None
    filled_at: int | None = None
    tombstone: int | None = None
    expires: float = 0.0


class FakeCacheTier:
    """The tier's semantics in memory, for in-process tests (values are JSON round-tripped).

    Args:
        ttl_s: how long entries and tombstones live after their last write.
        invalidators: as for :class:`CacheTier`.
        clock: for expiry; without one nothing expires.
    """

    def __init__(self, ttl_s: float = 3600.0, *, invalidators: Sequence[str] = (),
                 clock: IReactorTime | None = None) -> None:
        self.ttl_s = ttl_s
        self.keys = _Keys("fake", invalidators)
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._caches: dict[str, tuple[int, float]] = {}
        self._floors: dict[str, int] = {}

    def _now(self) -> float:
        return self._clock.seconds() if self._clock is not None else 0.0

    def _expiry(self) -> float:
        return self._now() + self.ttl_s if self._clock is not None else float("inf")

    def _entry(self, name: str, key: Sequence[Any]) -> _Entry | None:
        k = self.keys.entry(name, key)
        e = self._entries.get(k)
        if e is not None and e.expires <= self._now():
            del self._entries[k]
            return None
        return e

    def _cache_tombstone(self, name: str) -> int | None:
        c = self._caches.get(name)
        if c is None:
            return None
        if c[1] <= self._now():
            del self._caches[name]
            return None
        return c[0]

    def lookup(self, name: str, key: Sequence[Any]) -> Deferred[tuple[Any, int] | None]:
        e = self._entry(name, key)
        if e is None or e.value is None or e.filled_at is None:
            return succeed(None)
        floor = self._floors.get(self.keys.owner_floor(name, key))
        if floor is None or e.filled_at < floor:
            return succeed(None)
        c = self._cache_tombstone(name)
        if c is not None and e.filled_at < c:
            return succeed(None)
        return succeed((json.loads(e.value), e.filled_at))

    def get(self, name: str, key: Sequence[Any]) -> Deferred[tuple[bool, Any]]:
        return self.lookup(name, key).addCallback(lambda e: (False, None) if e is None else (True, e[0]))

    def fill(self, name: str, key: Sequence[Any], value: Any, position: int) -> Deferred[bool]:
        encoded = compact_json(value)
        floor = self._floors.get(self.keys.owner_floor(name, key))
        if floor is None or floor > position:
            return succeed(False)
        c = self._cache_tombstone(name)
        if c is not None and c > position:
            return succeed(False)
        e = self._entry(name, key)
        if e is not None and ((e.tombstone or 0) > position or (e.filled_at or 0) > position):
            return succeed(False)
        if e is None:
            e = self._entries[self.keys.entry(name, key)] = _Entry()
        e.value, e.filled_at, e.expires = encoded, position, self._expiry()
        return succeed(True)

    def invalidate(self, name: str, key: Sequence[Any] | None, position: int) -> Deferred[None]:
        if key is None:
            c = self._cache_tombstone(name)
            self._caches[name] = (max(c if c is not None else position, position), self._expiry())
            return succeed(None)
        e = self._entry(name, key)
        if e is None:
            e = self._entries[self.keys.entry(name, key)] = _Entry()
        e.tombstone = max(e.tombstone if e.tombstone is not None else position, position)
        e.value = e.filled_at = None
        e.expires = self._expiry()
        return succeed(None)

    def ensure_floor(self, instance: str, position: int) -> Deferred[bool]:
        k = self.keys.floor(instance)
        if k in self._floors:
            return succeed(False)
        self._floors[k] = position
        return succeed(True)

    def raise_floor(self, instance: str, position: int) -> Deferred[bool]:
        k = self.keys.floor(instance)
        if k in self._floors and self._floors[k] >= position:
            return succeed(False)
        self._floors[k] = position
        return succeed(True)

    def tombstone(self, name: str, key: Sequence[Any] | None) -> Deferred[int | None]:
        if key is None:
            return succeed(self._cache_tombstone(name))
        e = self._entry(name, key)
        return succeed(None if e is None else e.tombstone)

    def flush(self) -> None:
        """Forget everything, floors included, as a restarted Redis would."""
        self._entries.clear()
        self._caches.clear()
        self._floors.clear()

    def close(self) -> Deferred[Any]:
        return succeed(None)
