"""The event authorization rules: one pure function for local sends and remote PDUs alike.

:func:`authorize` decides whether one event may enter a room, given what this
server knows of the room (:class:`RoomView`: whether it exists, its members,
its join rule and power levels) and who is acting (this server for a local
event, the *authenticated* origin server for a PDU). It touches no database
and no clock; the persister builds the view inside its transaction and calls
it for every event of a batch, updating the view as events are accepted.

The rules, in the order they are checked (each refusal is a
:class:`~synflow.errors.PersistRefused` -- :class:`~synflow.errors.Forbidden`,
:class:`~synflow.errors.NotFound`, :class:`~synflow.errors.Conflict` or, for
malformed state content, :class:`~synflow.errors.BadEvent` -- with an
``errcode`` and a message; the HTTP edge gives each kind its status):

1. **Origin**: the sender's server is the acting server -- a remote server
   may only act for its own users, and a local event only for local users.
2. **Create**: ``m.room.create`` is only accepted from this server, with an
   empty state key, for a room ID of this server's namespace that does not
   exist yet (the client API's ``send`` refuses the type; only ``createRoom``
   makes it).
3. **Unknown room**: a local event for an unknown room is 404; a remote PDU
   for a room with no member of this server (unknown, or every local user
   left) is refused -- except the invite of one of this server's users,
   which makes this server a participant (the inviter is then taken as
   joined: its own server vouches for it).
4. **Sender**: the sender must be joined. A remote sender whose membership
   this server never saw (it joined before this server was in the room) is
   taken as joined only when the PDU comes from the room's own server (the
   server in the room ID), which judged that join itself.
5. **Membership** (``m.room.member``, the state key is the target):
   ``join`` only oneself, when already invited or joined, when the join
   rule is ``public``, or as the creator's first join, never when banned; ``invite`` only a user who is not
   joined (nor banned), by a joined sender with the ``invite`` level;
   ``leave`` of oneself when joined or invited, of another user (a kick) with
   the ``kick`` level and a level above the target's, of a banned user (an
   unban) with the ``ban`` level; ``ban`` with the ``ban`` level and a level
   above the target's.
6. **Other state events** need the ``state_default`` level;
   ``m.room.join_rules`` must name ``public`` or ``invite`` and
   ``m.room.power_levels`` must hold integer levels.

Power levels are the minimal part of ``m.room.power_levels``: ``users``,
``users_default``, ``kick``, ``ban``, ``invite`` and ``state_default``. A room
without that event gives its creator 100 and everyone else 0, with the
spec's defaults for the actions.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from synflow.errors import BadEvent, Conflict, Forbidden, NotFound

MEMBER = "m.room.member"
CREATE = "m.room.create"
JOIN_RULES = "m.room.join_rules"
POWER_LEVELS = "m.room.power_levels"

#: The power level ``createRoom`` gives the creator.
CREATOR_LEVEL = 100
#: The most users listed in one ``m.room.power_levels`` event.
MAX_POWER_USERS = 1000


class JoinRule(enum.Enum):
    """Who may join a room without an invite."""

    PUBLIC = "public"
    INVITE = "invite"


class Membership(enum.Enum):
    """The memberships the rules know."""

    JOIN = "join"
    INVITE = "invite"
    LEAVE = "leave"
    BAN = "ban"


def _forbidden(msg: str) -> Forbidden:
    return Forbidden("M_FORBIDDEN", msg)


def server_of(user_or_room_id: str) -> str:
    """The server part of ``@user:server`` or ``!room:server``."""
    return user_or_room_id.partition(":")[2]


def _is_user_id(value: str) -> bool:
    return value.startswith("@") and bool(server_of(value)) and len(value.partition(":")[0]) > 1


@attrs.frozen
class PowerLevels:
    """The minimal power levels of a room."""

    users: Mapping[str, int] = attrs.field(factory=dict)
    users_default: int = 0
    kick: int = 50
    ban: int = 50
    invite: int = 0
    state_default: int = 50

    def level_of(self, user_id: str) -> int:
        """The user's power level."""
        return self.users.get(user_id, self.users_default)

    @classmethod
    def without_event(cls, creator: str) -> PowerLevels:
        """The levels of a room with no ``m.room.power_levels`` event: the creator 100, state_default 0."""
        return cls(users={creator: CREATOR_LEVEL} if creator else {}, state_default=0)

    @classmethod
    def for_new_room(cls, creator: str) -> PowerLevels:
        """The levels ``createRoom`` writes."""
        return cls(users={creator: CREATOR_LEVEL})

    def to_content(self) -> dict[str, Any]:
        """The event content holding these levels."""
        return {"users": dict(self.users), "users_default": self.users_default, "kick": self.kick,
                "ban": self.ban, "invite": self.invite, "state_default": self.state_default}

    @classmethod
    def from_content(cls, content: Mapping[str, Any]) -> PowerLevels:
        """Parse an ``m.room.power_levels`` content (from a client or remote server).

        Raises:
            BadEvent: ``M_BAD_JSON`` if a level is not an integer or ``users`` is not a map of them.
        """
        def level(value: Any, name: str) -> int:
            if not isinstance(value, int) or isinstance(value, bool):
                raise BadEvent("M_BAD_JSON", f"power level {name} must be an integer, not {value!r}")
            return value

        users = content.get("users", {})
        if not isinstance(users, dict) or len(users) > MAX_POWER_USERS:
            raise BadEvent("M_BAD_JSON", f"power levels users must be a map of at most {MAX_POWER_USERS}")
        defaults = cls()
        return cls(
            users={str(u): level(v, f"users[{u}]") for u, v in users.items()},
            **{name: level(content.get(name, getattr(defaults, name)), name)
               for name in ("users_default", "kick", "ban", "invite", "state_default")},
        )


@attrs.define
class RoomView:
    """What the rules need to know of a room, as this server sees it.

    Attributes:
        room_id: the room.
        exists: whether this server has a record of the room.
        creator: its creator ("" when it was learned through an invite).
        members: user ID to membership, for every user this server saw a membership of.
        join_rule: the current ``m.room.join_rules`` (``invite`` without one).
        power_levels: the current ``m.room.power_levels``, or None without one.
    """

    room_id: str
    exists: bool = False
    creator: str = ""
    members: dict[str, str] = attrs.Factory(dict)
    join_rule: JoinRule = JoinRule.INVITE
    power_levels: PowerLevels | None = None

    def levels(self) -> PowerLevels:
        """The power levels in force."""
        return self.power_levels if self.power_levels is not None else PowerLevels.without_event(self.creator)

    def has_local_member(self, server_name: str) -> bool:
        """Whether a user of ``server_name`` is joined or invited."""
        return any(m in ("join", "invite") and server_of(u) == server_name for u, m in self.members.items())


class EventLike(Protocol):
    """The fields of an event the rules read."""

    @property
    def room_id(self) -> str: ...
    @property
    def type(self) -> str: ...
    @property
    def sender(self) -> str: ...
    @property
    def state_key(self) -> str | None: ...
    @property
    def content(self) -> dict[str, Any]: ...


@attrs.frozen
class Decision:
    """An accepted event, and what accepting it implies beyond its own state.

    Attributes:
        sender_vouched: the sender's membership was unknown here and is taken
            as ``join`` (rules 3 and 4): record it.
    """

    sender_vouched: bool = False


def authorize(event: EventLike, room: RoomView, *, server_name: str, origin: str) -> Decision:
    """Decide whether ``event`` may enter ``room`` (see the module docstring for the rules).

    Args:
        event: the event, from a client (``origin == server_name``) or a remote server.
        room: the room as this server sees it just before the event.
        server_name: this server.
        origin: the server acting: this server for a local event, the
            authenticated origin of a PDU.

    Returns:
        The decision, if the event is allowed.

    Raises:
        PersistRefused: the event is refused (:class:`~synflow.errors.Forbidden`,
            :class:`~synflow.errors.NotFound`, :class:`~synflow.errors.Conflict`
            or :class:`~synflow.errors.BadEvent`).
    """
    local = origin == server_name
    if server_of(event.sender) != origin:
        raise _forbidden(f"sender {event.sender} is not a user of {origin}; a server may only act for its own users")
    if event.type == CREATE:
        _check_create(event, room, server_name, local)
        return Decision()
    invite_of_local = (event.type == MEMBER and event.content.get("membership") == "invite"
                       and event.state_key is not None and server_of(event.state_key) == server_name)
    if not room.exists:
        if local:
            raise NotFound("M_NOT_FOUND", f"unknown room {event.room_id}")
        if not invite_of_local or server_of(event.room_id) == server_name:
            raise _forbidden(f"this server has no member in room {event.room_id}")
    elif not local and not room.has_local_member(server_name) and not invite_of_local:
        raise _forbidden(f"this server has no member in room {event.room_id}")
    vouched = False
    sender_membership = room.members.get(event.sender)
    if sender_membership is None and not local and (
            not room.exists or (origin == server_of(event.room_id) != server_name)):
        sender_membership, vouched = "join", True
    if event.type == MEMBER and event.state_key is not None:
        _check_membership(event, room, sender_membership)
    else:
        if sender_membership != "join":
            raise _forbidden(f"{event.sender} is not joined to room {event.room_id}")
        if event.state_key is not None:
            _check_state(event, room)
    return Decision(sender_vouched=vouched)


def _check_create(event: EventLike, room: RoomView, server_name: str, local: bool) -> None:
    if not local:
        raise _forbidden(f"a remote server cannot create room {event.room_id} here")
    if server_of(event.room_id) != server_name:
        raise _forbidden(f"room {event.room_id} is not in this server's namespace ({server_name})")
    if event.state_key != "":
        raise BadEvent("M_BAD_JSON", "m.room.create must have an empty state key")
    if room.exists:
        raise Conflict("M_ROOM_IN_USE", f"room {event.room_id} already exists")


def _check_membership(event: EventLike, room: RoomView, sender_membership: str | None) -> None:
    target = event.state_key
    assert target is not None
    raw = event.content.get("membership")
    try:
        membership = Membership(raw)
    except ValueError:
        raise BadEvent("M_BAD_JSON", f"membership {raw!r} is not one of join, invite, leave, ban") from None
    if not _is_user_id(target):
        raise BadEvent("M_BAD_JSON", f"state key {target!r} of a membership is not a user ID")
    current = room.members.get(target)
    if current is None and target == event.sender:
        current = sender_membership  # a sender taken as joined (rule 4) may leave like one
    levels = room.levels()
    sender_level = levels.level_of(event.sender)
    if membership is Membership.JOIN:
        if target != event.sender:
            raise _forbidden("a user can only join as themselves")
        if current == "ban":
            raise _forbidden(f"{target} is banned from room {event.room_id}")
        first_join = target == room.creator and not room.members
        if (current not in ("join", "invite") and sender_membership != "join" and not first_join
                and room.join_rule is not JoinRule.PUBLIC):
            raise _forbidden(f"room {event.room_id} is invite-only and {target} is not invited")
        return
    if membership is Membership.LEAVE and target == event.sender:
        if current not in ("join", "invite"):
            raise _forbidden(f"{target} is not in room {event.room_id}")
        return
    if sender_membership != "join":
        raise _forbidden(f"{event.sender} is not joined to room {event.room_id}")
    if membership is Membership.INVITE:
        if current in ("join", "ban"):
            raise _forbidden(f"{target} is {'already joined to' if current == 'join' else 'banned from'} "
                             f"room {event.room_id}; an invite cannot change that")
        if sender_level < levels.invite:
            raise _forbidden(f"{event.sender} has power {sender_level}; inviting needs {levels.invite}")
        return
    if membership is Membership.LEAVE and current == "ban":
        action, needed = "unban", levels.ban
    elif membership is Membership.LEAVE:
        if current not in ("join", "invite"):
            raise _forbidden(f"{target} is not in room {event.room_id}")
        action, needed = "kick", levels.kick
    else:
        action, needed = "ban", levels.ban
    if sender_level < needed or sender_level <= levels.level_of(target):
        raise _forbidden(f"{event.sender} has power {sender_level}; to {action} {target} needs {needed} "
                         f"and more than the target's {levels.level_of(target)}")


def _check_state(event: EventLike, room: RoomView) -> None:
    levels = room.levels()
    sender_level = levels.level_of(event.sender)
    if sender_level < levels.state_default:
        raise _forbidden(f"{event.sender} has power {sender_level}; {event.type} needs {levels.state_default}")
    if event.type == JOIN_RULES:
        rule = event.content.get("join_rule")
        if rule not in {r.value for r in JoinRule}:
            raise BadEvent("M_BAD_JSON", f"join_rule {rule!r} is not public or invite")
    elif event.type == POWER_LEVELS:
        PowerLevels.from_content(event.content)


def apply(event: EventLike, room: RoomView, decision: Decision) -> None:
    """Update ``room`` with an accepted event, so the next event of a batch sees it."""
    room.exists = True
    if decision.sender_vouched:
        room.members[event.sender] = "join"
    if event.state_key is None:
        return
    if event.type == MEMBER:
        membership = event.content.get("membership")
        if isinstance(membership, str):
            room.members[event.state_key] = membership
    elif event.type == JOIN_RULES and event.state_key == "":
        room.join_rule = JoinRule(event.content["join_rule"])
    elif event.type == POWER_LEVELS and event.state_key == "":
        room.power_levels = PowerLevels.from_content(event.content)
    elif event.type == CREATE:
        room.creator = event.sender
