"""Vector-clock stream tokens.

A token says how far a reader has got in a multi-writer stream: for each
writer (by its persistent small integer instance ID) the position up to which
the reader has seen every fact of that writer. It is written compactly:

* ``s<N>`` -- every writer is at ``N``;
* ``m<min>~<id>.<pos>~<id>.<pos>...`` -- every writer is at least at ``min``;
  the listed writers, whose positions are strictly greater than ``min``, are
  at ``pos``. IDs are listed in ascending order. A trailing ``~`` (``m5~``) is
  accepted on input, as Synapse once wrote it.

The effective position of writer ``w`` is ``max(min, pos[w])`` -- the minimum
constrains every writer, listed or not. Tokens compare point-wise
(:meth:`StreamToken.is_before_or_eq`, a partial order) and merge by point-wise
maximum (:meth:`StreamToken.merge`, the least upper bound).

Parsing refuses anything malformed with a :class:`~synflow.errors.TokenError`
whose message says what is wrong; the client API turns it into HTTP 400.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Final

import attrs

from synflow.errors import TokenError

#: Largest stream position a token may carry (fits a signed 64-bit integer).
MAX_POSITION: Final = 2**63 - 1
#: Largest instance ID a token may carry.
MAX_INSTANCE_ID: Final = 2**31 - 1
#: Longest token text accepted (guards the parser against huge inputs).
MAX_TOKEN_LENGTH: Final = 4096

_NUM = r"(0|[1-9][0-9]{0,18})"
_S_RE = re.compile(rf"s{_NUM}\Z")
_M_RE = re.compile(rf"m{_NUM}((?:~{_NUM}\.{_NUM})*)(~?)\Z")
_PART_RE = re.compile(rf"~{_NUM}\.{_NUM}")

#: Tokens parsed lately, by their text (a process parses the same few tokens over and over: every
#: sync chain sends back what the process gave it). Only texts up to :data:`_CACHED_TEXT_LENGTH`
#: characters are kept, and the whole cache is dropped when it reaches :data:`_CACHED_TOKENS`
#: entries, so it holds at most about 1 MB whatever a client sends.
_parsed: dict[str, StreamToken] = {}
_CACHED_TOKENS: Final = 4096
_CACHED_TEXT_LENGTH: Final = 256


def _canonical(minimum: int, positions: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    return tuple(sorted((i, p) for i, p in positions if p > minimum))


@attrs.frozen(order=False)
class StreamToken:
    """A vector-clock position in a multi-writer stream.

    Attributes:
        minimum: every writer is at least here.
        positions: ``(instance_id, position)`` pairs, ascending by ID, each
            position strictly greater than ``minimum``.
    """

    minimum: int
    positions: tuple[tuple[int, int], ...] = ()

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.minimum <= MAX_POSITION:
            raise TokenError(f"token minimum {self.minimum} is out of range")
        last = -1
        for instance_id, pos in self.positions:
            if instance_id <= last:
                raise TokenError("token positions must be listed once each, by ascending instance id")
            if not 0 <= instance_id <= MAX_INSTANCE_ID:
                raise TokenError(f"instance id {instance_id} is out of range")
            if not self.minimum < pos <= MAX_POSITION:
                raise TokenError(
                    f"position {pos} of instance {instance_id} must be greater than the minimum {self.minimum}"
                )
            last = instance_id

    # -- construction -------------------------------------------------------------

    @classmethod
    def at(cls, position: int) -> StreamToken:
        """The token ``s<position>``: every writer at ``position``."""
        return cls(position)

    @classmethod
    def from_positions(cls, positions: Mapping[int, int], minimum: int | None = None) -> StreamToken:
        """The token for a full vector clock ``{instance_id: position}``.

        The minimum is the smallest position (or ``minimum`` if given, which
        must not exceed it); only writers ahead of it are listed.
        """
        if minimum is None:
            minimum = min(positions.values()) if positions else 0
        elif positions and minimum > min(positions.values()):
            raise TokenError(f"minimum {minimum} exceeds a writer's position")
        return cls(minimum, _canonical(minimum, positions.items()))

    @classmethod
    def with_minimum(cls, minimum: int, positions: Mapping[int, int]) -> StreamToken:
        """A token with this minimum, listing only the positions above it."""
        return cls(minimum, _canonical(minimum, positions.items()))

    def ids(self) -> set[int]:
        """The instance IDs listed explicitly."""
        return {i for i, _ in self.positions}

    def clamp(self, ceiling: int) -> StreamToken:
        """Every writer's effective position capped at ``ceiling``."""
        minimum = min(self.minimum, ceiling)
        return StreamToken.with_minimum(minimum, {i: min(p, ceiling) for i, p in self.positions})

    @classmethod
    def parse(cls, text: str) -> StreamToken:
        """Parse ``s<N>`` or ``m<min>~<id>.<pos>...``.

        Raises:
            TokenError: with a message saying what is malformed.
        """
        cached = _parsed.get(text) if type(text) is str else None
        if cached is not None:
            return cached
        token = cls._parse(text)
        if len(text) <= _CACHED_TEXT_LENGTH and cls is StreamToken:
            if len(_parsed) >= _CACHED_TOKENS:
                _parsed.clear()
            _parsed[text] = token
        return token

    @classmethod
    def _parse(cls, text: str) -> StreamToken:
        if not isinstance(text, str):
            raise TokenError(f"a token must be a string, got {type(text).__name__}")
        if not text:
            raise TokenError("empty token")
        if len(text) > MAX_TOKEN_LENGTH:
            raise TokenError(f"token is {len(text)} characters long, more than {MAX_TOKEN_LENGTH}")
        shown = text if len(text) <= 60 else text[:57] + "..."
        if text[0] == "s":
            match = _S_RE.match(text)
            if not match:
                raise TokenError(f"malformed token {shown!r}: expected s<N> with N a non-negative integer")
            return cls(_bounded(match.group(1), shown))
        if text[0] == "m":
            match = _M_RE.match(text)
            if not match:
                raise TokenError(
                    f"malformed token {shown!r}: expected m<min>~<id>.<pos>~... with non-negative integers"
                )
            minimum = _bounded(match.group(1), shown)
            seen: dict[int, int] = {}
            for part in _PART_RE.finditer(match.group(2)):
                instance_id = _bounded(part.group(1), shown)
                pos = _bounded(part.group(2), shown)
                if instance_id in seen:
                    raise TokenError(f"malformed token {shown!r}: instance id {instance_id} appears twice")
                if instance_id > MAX_INSTANCE_ID:
                    raise TokenError(f"malformed token {shown!r}: instance id {instance_id} is out of range")
                if pos <= minimum:
                    raise TokenError(
                        f"malformed token {shown!r}: position {pos} of instance {instance_id} "
                        f"is not greater than the minimum {minimum}"
                    )
                seen[instance_id] = pos
            return cls(minimum, tuple(sorted(seen.items())))
        raise TokenError(f"malformed token {shown!r}: a token starts with 's' or 'm'")

    # -- reading --------------------------------------------------------------------

    def get(self, instance_id: int) -> int:
        """The effective position of one writer: its entry, or the minimum."""
        for i, pos in self.positions:
            if i == instance_id:
                return pos
        return self.minimum

    def as_dict(self) -> dict[int, int]:
        """The listed writers' positions (writers at the minimum are omitted)."""
        return dict(self.positions)

    @property
    def maximum(self) -> int:
        """The largest position any writer has in this token."""
        return max((p for _, p in self.positions), default=self.minimum)

    def covers(self, instance_id: int, stream_id: int) -> bool:
        """Whether the fact ``stream_id`` of writer ``instance_id`` is at or before this token."""
        return stream_id <= self.get(instance_id)

    # -- algebra ----------------------------------------------------------------------

    def is_before_or_eq(self, other: StreamToken) -> bool:
        """Point-wise ``<=``: every writer's position here is at most its position there."""
        floor = other.minimum
        if self.minimum > floor:
            return False
        theirs = other.positions
        if self.positions == theirs:
            return True  # the common case in sync: the same writers' positions
        # A writer listed only there is here at the minimum, at most ``floor`` and so at most its
        # position there: only the writers listed here need comparing. Both lists ascend by ID.
        j, n = 0, len(theirs)
        for i, p in self.positions:
            while j < n and theirs[j][0] < i:
                j += 1
            if p > (theirs[j][1] if j < n and theirs[j][0] == i else floor):
                return False
        return True

    def __le__(self, other: object) -> bool:
        if not isinstance(other, StreamToken):
            return NotImplemented
        return self.is_before_or_eq(other)

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, StreamToken):
            return NotImplemented
        return other.is_before_or_eq(self)

    def merge(self, other: StreamToken) -> StreamToken:
        """The point-wise maximum: the least token at or after both."""
        if other.is_before_or_eq(self):
            return self  # the common case: a sync's ``since`` merged into the newer ``now``
        if self.is_before_or_eq(other):
            return other
        mine, theirs = self.minimum, other.minimum
        minimum = max(mine, theirs)
        listed = dict(other.positions)
        merged = {i: max(p, listed.pop(i, theirs)) for i, p in self.positions}
        merged.update((i, max(p, mine)) for i, p in listed.items())
        return StreamToken(minimum, _canonical(minimum, merged.items()))

    def advance(self, instance_id: int, position: int) -> StreamToken:
        """This token with one writer moved forward to ``position`` (never back)."""
        return self.merge(StreamToken(self.minimum, _canonical(self.minimum, [(instance_id, position)])))

    def __str__(self) -> str:
        if not self.positions:
            return f"s{self.minimum}"
        return f"m{self.minimum}" + "".join(f"~{i}.{p}" for i, p in self.positions)


def _bounded(digits: str, shown: str) -> int:
    value = int(digits)
    if value > MAX_POSITION:
        raise TokenError(f"malformed token {shown!r}: {digits} does not fit in 64 bits")
    return value
