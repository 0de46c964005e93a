"""Remote servers' verify keys: pinned in config, else fetched, checked and cached.

:class:`KeyRing` answers "which public key is ``origin``'s ``key_id``?" for
the inbound request check (:mod:`synflow.federation.auth`):

* a server listed in ``federation.trusted_keys`` is pinned: only the
  configured keys are used and its key endpoint is never fetched;
* any other server's keys come from its own ``GET /_matrix/key/v2/server``
  (through the same ``federation.destinations`` mapping and address policy
  as sending), whose self-signature :func:`~synflow.federation.keys.parse_server_keys`
  verifies; they are cached until their ``valid_until_ts`` (at most seven
  days).

Concurrent look-ups of one server share one fetch. A server whose fetch
failed, or whose fresh keys lack the asked-for key ID, is not fetched again
for :data:`REFETCH_INTERVAL_MS`: a stream of forged requests cannot make
this server hammer the claimed origin. At most :data:`MAX_CACHED_SERVERS`
servers are cached (the entry expiring first is dropped to make room).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from signedjson.types import VerifyKey
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from synflow.federation.keys import (
    KeyResponseError,
    ServerKeys,
    decode_verify_key,
    parse_server_keys,
)
from synflow.metrics import counter

logger = logging.getLogger(__name__)

KEY_FETCHES = counter("synflow_federation_key_fetches_total", "Fetches of remote servers' keys", ["outcome"])

#: The fewest ms between two fetches of one server's keys.
REFETCH_INTERVAL_MS = 30_000
#: The most servers whose fetched keys are cached at once.
MAX_CACHED_SERVERS = 10_000

#: ``fetch_keys(server_name)`` -> the decoded JSON body of its key endpoint.
FetchKeys = Callable[[str], "Deferred[Any]"]


class KeyUnavailable(Exception):
    """No trusted key is known for the asked-for server and key ID."""


def pinned_keys(trusted: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, VerifyKey]]:
    """``federation.trusted_keys`` decoded: server name -> key ID -> verify key.

    Raises:
        ValueError: naming the server and key that is not an ed25519 key in
            unpadded base64.
    """
    result: dict[str, dict[str, VerifyKey]] = {}
    for server, keys in trusted.items():
        decoded: dict[str, VerifyKey] = {}
        for kid, key in keys.items():
            try:
                decoded[kid] = decode_verify_key(kid, key)
            except ValueError as e:
                raise ValueError(f"{server}: {e}") from None
        result[server] = decoded
    return result


class KeyRing:
    """Remote servers' verify keys (see the module docstring).

    Args:
        fetch_keys: fetches a server's key endpoint body (a Deferred).
        clock: gives now (``seconds()``).
        pinned: server name -> key ID -> verify key, from
            ``federation.trusted_keys`` (see :func:`pinned_keys`).
    """

    def __init__(self, fetch_keys: FetchKeys, clock: IReactorTime,
                 pinned: Mapping[str, Mapping[str, VerifyKey]] | None = None) -> None:
        self._fetch_keys = fetch_keys
        self._clock = clock
        self._pinned = {server: dict(keys) for server, keys in (pinned or {}).items()}
        self._cache: dict[str, ServerKeys] = {}
        self._last_fetch_ms: dict[str, int] = {}
        self._fetching: dict[str, Deferred[None]] = {}
        self.fetches = 0

    def _now_ms(self) -> int:
        return int(self._clock.seconds() * 1000)

    async def verify_key(self, server_name: str, key_id: str) -> VerifyKey:
        """The trusted verify key ``key_id`` of ``server_name``.

        Raises:
            KeyUnavailable: the server is pinned and lacks that key, or its
                key endpoint could not be fetched or checked, or does not
                list that key.
        """
        pinned = self._pinned.get(server_name)
        if pinned is not None:
            if key_id in pinned:
                return pinned[key_id]
            raise KeyUnavailable(f"{key_id} is not one of the keys pinned for {server_name}")
        key = self._cached(server_name, key_id)
        if key is not None:
            return key
        await self._refresh(server_name)
        key = self._cached(server_name, key_id)
        if key is None:
            raise KeyUnavailable(f"{server_name} does not vouch for a key {key_id[:80]}")
        return key

    def _cached(self, server_name: str, key_id: str) -> VerifyKey | None:
        entry = self._cache.get(server_name)
        if entry is None:
            return None
        if entry.valid_until_ts <= self._now_ms():
            del self._cache[server_name]
            return None
        return entry.keys.get(key_id)

    async def _refresh(self, server_name: str) -> None:
        running = self._fetching.get(server_name)
        if running is None:
            last = self._last_fetch_ms.get(server_name)
            if last is not None and self._now_ms() - last < REFETCH_INTERVAL_MS:
                raise KeyUnavailable(f"{server_name}'s keys were fetched less than {REFETCH_INTERVAL_MS} ms ago")
            self._last_fetch_ms[server_name] = self._now_ms()
            if len(self._last_fetch_ms) > MAX_CACHED_SERVERS:
                self._last_fetch_ms.pop(next(iter(self._last_fetch_ms)))
            running = Deferred.fromCoroutine(self._fetch(server_name))
            self._fetching[server_name] = running
            running.addBoth(self._done, server_name)
        waiter: Deferred[None] = Deferred()

        def wake(result: object) -> object:
            waiter.callback(None)
            return result

        running.addBoth(wake)
        await waiter
        if server_name not in self._cache:
            raise KeyUnavailable(f"could not fetch {server_name}'s keys (see the log)")

    def _done(self, result: Any, server_name: str) -> None:
        self._fetching.pop(server_name, None)

    async def _fetch(self, server_name: str) -> None:
        self.fetches += 1
        try:
            body = await self._fetch_keys(server_name)
            keys = parse_server_keys(server_name, body, self._now_ms())
        except KeyResponseError as e:
            KEY_FETCHES.labels(outcome="refused").inc()
            logger.warning("keys of %s refused: %s", server_name, e)
            return
        except Exception as e:
            KEY_FETCHES.labels(outcome="failed").inc()
            logger.warning("could not fetch the keys of %s: %s: %s", server_name, type(e).__name__, e)
            return
        KEY_FETCHES.labels(outcome="ok").inc()
        if server_name not in self._cache and len(self._cache) >= MAX_CACHED_SERVERS:
            first = min(self._cache, key=lambda name: self._cache[name].valid_until_ts)
            del self._cache[first]
        self._cache[server_name] = keys
        logger.info("fetched keys %s of %s, valid until %d", sorted(keys.keys), server_name, keys.valid_until_ts)
