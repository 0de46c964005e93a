"""Stable key -> instance mapping, the same one Synapse uses.

``shard_for(key, instances)`` hashes the UTF-8 key with SHA-256, reads the
digest as a little-endian integer, and takes it modulo the number of
instances to index the configured, *ordered* list. The mapping depends only
on the key and the list, so every process (and every restart) agrees on it:
events shard by ``room_id`` over ``stream_writers.events``, federation by
destination over ``federation_sender_instances``, shared-cache keys over
``caches.cache_invalidator_instances``. Reordering the list moves keys.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from synflow.errors import ShardingError


def shard_index(key: str, count: int) -> int:
    """The index ``key`` maps to among ``count`` instances."""
    if count <= 0:
        raise ShardingError(f"cannot shard {key!r} over no instances")
    if count == 1:
        return 0
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest, "little") % count


def shard_for(key: str, instances: Sequence[str]) -> str:
    """The instance of the ordered list ``instances`` that owns ``key``.

    Raises:
        ShardingError: ``instances`` is empty.
    """
    return instances[shard_index(key, len(instances))]
