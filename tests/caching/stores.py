"""Small stores used by the caching tests, and a metric reader."""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY
from twisted.internet.defer import Deferred

from synflow.caching import cached


def sample(name: str, **labels: str) -> float:
    """The current value of one metric sample (0 if it has none yet)."""
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


class DictStore:
    """A store whose reads come from a dict, synchronously, counting them."""

    def __init__(self, data: dict[Any, Any] | None = None) -> None:
        self.data: dict[Any, Any] = dict(data or {})
        self.reads: list[Any] = []

    @cached(max_entries=3)
    def get_user(self, user_id: str) -> Any:
        self.reads.append(("get_user", user_id))
        return self.data.get(user_id)

    @cached()
    def get_pair(self, a: str, b: str = "default") -> Any:
        self.reads.append(("get_pair", a, b))
        return f"{a}+{b}"


class GatedStore:
    """A store whose reads wait for the test to fire them (one Deferred per read)."""

    def __init__(self) -> None:
        self.gates: list[tuple[str, Deferred[Any]]] = []

    def _gate(self, what: str) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.gates.append((what, d))
        return d

    @cached(name="gated_get_profile")
    def get_profile(self, user_id: str) -> Deferred[Any]:
        return self._gate(user_id)


class RoomStore:
    """Room- and user-keyed caches, as a current-state change invalidates them."""

    def __init__(self) -> None:
        self.members: dict[str, list[str]] = {}
        self.rooms_of: dict[str, list[str]] = {}
        self.names: dict[str, str] = {}

    @cached(room_key=True)
    def get_users_in_room(self, room_id: str) -> list[str]:
        return list(self.members.get(room_id, []))

    @cached(room_key=True)
    def get_room_summary(self, room_id: str) -> dict[str, Any]:
        return {"joined": len(self.members.get(room_id, []))}

    @cached(user_key=True)
    def get_rooms_for_user(self, user_id: str) -> list[str]:
        return list(self.rooms_of.get(user_id, []))

    @cached()
    def get_display_name(self, user_id: str) -> str | None:
        return self.names.get(user_id)


class TierStore:
    """A store with a tier-backed cache whose database reads the test answers by hand."""

    def __init__(self) -> None:
        self.gates: list[tuple[str, Deferred[Any]]] = []
        self.db: dict[str, Any] = {}

    @cached(name="tier_get_user", tier=True)
    def get_user(self, user_id: str) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.gates.append((user_id, d))
        return d

    def answer(self, index: int = 0) -> None:
        """Answer a pending read with what the database holds *now*."""
        user_id, d = self.gates.pop(index)
        d.callback(self.db.get(user_id))

    def answer_with(self, value: Any, index: int = 0) -> None:
        """Answer a pending read with ``value`` (what the database held when it read)."""
        _user_id, d = self.gates.pop(index)
        d.callback(value)
