"""The vector-clock token grammar in pure Python.

A token is ``s<N>`` (no writer ahead of the minimum ``N``) or ``m<min>~<id>.<pos>~…`` with an
optional trailing ``~``. ``eff(t, W)`` is ``max(min, pos[W])`` when W is listed and ``min``
otherwise. The Spark job implements the same grammar with SQL expressions
(:mod:`spark.checks_syntax`); the reference checker and the generator use this module.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from .checks import MAX_INT, MAX_LONG

#: The grammar; ``[0-9]`` rather than ``\\d`` so that Python and Java agree.
TOKEN_RE = re.compile(r"^(?:s([0-9]+)|m([0-9]+)((?:~[0-9]+\.[0-9]+)*)~?)$")


@dataclass(frozen=True)
class ParsedToken:
    """A token that passed the grammar and the instance-id checks.

    Attributes:
        min: the minimum position.
        components: ``(instance_id, pos)`` in the order listed.
    """

    min: int
    components: tuple[tuple[int, int], ...]

    def eff(self, instance_id: int | None) -> int:
        """The effective position of the writer with ``instance_id`` (None: an unlisted writer)."""
        best = self.min
        for iid, pos in self.components:
            if iid == instance_id and pos > best:
                best = pos
        return best

    @property
    def claim(self) -> int:
        """The highest stream id the token claims for any writer."""
        return max([self.min, *(p for _, p in self.components)])


def parse(token: str | None, known_ids: Mapping[int, str] | set[int]) -> tuple[ParsedToken | None, str | None]:
    """Parse ``token``.

    Args:
        token: the token text.
        known_ids: the instance ids of ``instance_map``.

    Returns:
        ``(parsed, None)`` for a valid token, ``(None, reason)`` otherwise, where reason is one of
        ``empty``, ``topological``, ``grammar``, ``overflow``, ``duplicate_writer_id``,
        ``unknown_writer_id``.
    """
    if token is None or token == "":
        return None, "empty"
    m = TOKEN_RE.match(token)
    if m is None:
        return None, "topological" if token.startswith("t") else "grammar"
    if m.group(1) is not None:
        lo = int(m.group(1))
        return (None, "overflow") if lo > MAX_LONG else (ParsedToken(lo, ()), None)
    lo = int(m.group(2))
    comps = []
    for part in m.group(3).split("~"):
        if part:
            iid, pos = part.split(".")
            comps.append((int(iid), int(pos)))
    if lo > MAX_LONG or any(i > MAX_INT or p > MAX_LONG for i, p in comps):
        return None, "overflow"
    ids = [i for i, _ in comps]
    if len(set(ids)) != len(ids):
        return None, "duplicate_writer_id"
    if any(i not in known_ids for i in ids):
        return None, "unknown_writer_id"
    return ParsedToken(lo, tuple(comps)), None


def encode(positions: Mapping[int, int]) -> str:
    """The canonical token for ``instance_id -> position`` (listing only writers above the min).

    Args:
        positions: every writer's position (at least one).

    Returns:
        ``s<min>`` or ``m<min>~<id>.<pos>…`` with ids ascending.
    """
    lo = min(positions.values())
    ahead = sorted((i, p) for i, p in positions.items() if p > lo)
    if not ahead:
        return f"s{lo}"
    return f"m{lo}" + "".join(f"~{i}.{p}" for i, p in ahead)
