"""Stable key -> instance mapping, the same one Synapse uses.

``shard_for(key, instances)`` hashes the UTF-8 key with SHA-256, reads the
digest as a little-endian integer, and takes it modulo the number of
instances to index the configured, *ordered* list. The mapping depends only
on the key and the list, so every process (and every restart) agrees on it:
events shard by ``room_id`` over ``stream_writers.events``, federation by
destination over ``federation_sender_instances``, shared-cache keys over
``caches.cache_invalidator_instances``. Reordering the list moves keys.

A stream that reshards live (``events``) follows a :class:`ShardMap`: the
configured list as its base (owners by ``shard_for``), then one step per
epoch -- a writer added or removed. Each step moves only the keys it must:
adding ``w`` moves to ``w`` the keys that rendezvous hashing over the new
list gives to ``w`` (about ``1/n`` of them), removing ``w`` moves only
``w``'s keys, to the rendezvous winner among those left. A map with no steps
is ``shard_for`` over the base, so a deployment that never reshards keeps
its mapping.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Final, Literal

import attrs

from synflow.errors import ShardingError

#: Owners a :class:`ShardMap` remembers before it forgets them all (they are recomputed on demand).
MAP_CACHE_SIZE: Final = 200_000


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


def rendezvous(key: str, instances: Sequence[str], salt: int = 0) -> str:
    """The instance with the highest hash of ``(salt, instance, key)``: the rendezvous (HRW) winner.

    Adding an instance takes from every other only the keys it now wins;
    removing one gives away only its own keys. A :class:`ShardMap` salts each
    step with its number, so that one step's winners do not depend on an
    earlier step's (which would skew where a removed writer's keys go).

    Raises:
        ShardingError: ``instances`` is empty.
    """
    if not instances:
        raise ShardingError(f"cannot shard {key!r} over no instances")
    best, best_score = instances[0], b""
    encoded = key.encode("utf-8")
    for instance in instances:
        name = instance.encode("utf-8")
        score = hashlib.blake2b(b"%d\0%s\0%s" % (salt, name, encoded), digest_size=8).digest() + name
        if score > best_score:
            best, best_score = instance, score
    return best


@attrs.frozen
class ShardStep:
    """One epoch's change: a writer added or removed."""

    op: Literal["add", "remove"]
    writer: str


class ShardMap:
    """Key -> owner for a stream that reshards: the base list, then one :class:`ShardStep` per epoch.

    Args:
        base: the initial ordered writers (``stream_writers.<stream>``, as stored at the first reshard).
        steps: the changes since, oldest first.
        epoch: the epoch this map is (the number of its last step; 0 for the base).

    Raises:
        ShardingError: the base is empty, a step adds a writer already there or removes
            one not there, or a step would leave no writer.
    """

    def __init__(self, base: Sequence[str], steps: Iterable[ShardStep] = (), epoch: int | None = None) -> None:
        self.base: tuple[str, ...] = tuple(base)
        self.steps: tuple[ShardStep, ...] = tuple(steps)
        if not self.base:
            raise ShardingError("a shard map needs at least one writer")
        writers = list(self.base)
        self._lists: list[tuple[str, ...]] = []
        for step in self.steps:
            if step.op == "add":
                if step.writer in writers:
                    raise ShardingError(f"cannot add {step.writer!r}: it is already a writer")
                writers.append(step.writer)
            else:
                if step.writer not in writers:
                    raise ShardingError(f"cannot remove {step.writer!r}: it is not a writer")
                if len(writers) == 1:
                    raise ShardingError(f"cannot remove {step.writer!r}: it is the last writer")
                writers.remove(step.writer)
            self._lists.append(tuple(writers))
        self.writers: tuple[str, ...] = tuple(writers)
        self.epoch = len(self.steps) if epoch is None else epoch
        self._cache: dict[str, str] = {}

    def then(self, step: ShardStep, epoch: int | None = None) -> ShardMap:
        """This map with one more step (epoch ``epoch``, by default this one's plus one)."""
        return ShardMap(self.base, (*self.steps, step), self.epoch + 1 if epoch is None else epoch)

    def owner(self, key: str) -> str:
        """The writer that owns ``key`` in this epoch."""
        owner = self._cache.get(key)
        if owner is not None:
            return owner
        owner = shard_for(key, self.base)
        for number, (step, writers) in enumerate(zip(self.steps, self._lists, strict=True), 1):
            if step.op == "add":
                if rendezvous(key, writers, number) == step.writer:
                    owner = step.writer
            elif owner == step.writer:
                owner = rendezvous(key, writers, number)
        if len(self._cache) >= MAP_CACHE_SIZE:
            self._cache.clear()
        self._cache[key] = owner
        return owner

    def __repr__(self) -> str:
        return f"ShardMap(epoch={self.epoch}, writers={list(self.writers)})"
