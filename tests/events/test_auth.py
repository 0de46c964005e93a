"""The event authorization rules (synflow.events.auth), one table row per rule and outcome."""

from __future__ import annotations

from typing import Any

import attrs
from twisted.trial.unittest import SynchronousTestCase

from synflow.errors import PersistRefused
from synflow.events.auth import (
    CREATE,
    JOIN_RULES,
    MEMBER,
    POWER_LEVELS,
    Decision,
    JoinRule,
    PowerLevels,
    RoomView,
    apply,
    authorize,
)
from synflow.http.server import refusal_status

HS = "hs.test"
REMOTE = "remote.test"
ROOM = f"!r:{HS}"
REMOTE_ROOM = f"!r:{REMOTE}"
ALICE, BOB, CAROL, DAVE = f"@alice:{HS}", f"@bob:{HS}", f"@carol:{HS}", f"@dave:{HS}"
RITA, RON = f"@rita:{REMOTE}", f"@ron:{REMOTE}"


@attrs.frozen
class Ev:
    room_id: str
    type: str
    sender: str
    content: dict[str, Any]
    state_key: str | None = None


def member(sender: str, target: str, membership: str, room: str = ROOM) -> Ev:
    return Ev(room, MEMBER, sender, {"membership": membership}, target)


def msg(sender: str, room: str = ROOM) -> Ev:
    return Ev(room, "m.room.message", sender, {"body": "hi"})


def room(members: dict[str, str] | None = None, *, rule: JoinRule = JoinRule.INVITE,
         levels: PowerLevels | None = None, room_id: str = ROOM, creator: str = ALICE) -> RoomView:
    """A room alice created: alice joined, bob joined, carol invited unless ``members`` says otherwise."""
    base = {ALICE: "join", BOB: "join", CAROL: "invite"} if members is None else members
    return RoomView(room_id, True, creator, dict(base), rule, levels)


NONE = RoomView(ROOM)
REMOTE_NONE = RoomView(REMOTE_ROOM)
OK, VOUCHED = Decision(), Decision(sender_vouched=True)
# The room as a server that learned it through an invite sees it: rita (vouched inviter) joined, bob invited.
LEARNED = room({RITA: "join", BOB: "invite"}, room_id=REMOTE_ROOM, creator="")

#: (rule, event, room, origin, expected Decision or (status, errcode, part of the message)).
TABLE: list[tuple[str, Ev, RoomView, str, Any]] = [
    # 1. origin: a server acts only for its own users.
    ("remote sender from another server", msg(ALICE), room(), REMOTE, (403, "M_FORBIDDEN", "not a user of")),
    ("local event for a remote user", msg(RITA), room({RITA: "join"}), HS, (403, "M_FORBIDDEN", "not a user of")),
    # 2. create.
    ("create a new local room", Ev(ROOM, CREATE, ALICE, {}, ""), NONE, HS, OK),
    ("create an existing room", Ev(ROOM, CREATE, ALICE, {}, ""), room(), HS, (409, "M_ROOM_IN_USE", "exists")),
    ("create in another namespace", Ev(REMOTE_ROOM, CREATE, ALICE, {}, ""), REMOTE_NONE, HS,
     (403, "M_FORBIDDEN", "namespace")),
    ("create by a remote server", Ev(REMOTE_ROOM, CREATE, RITA, {}, ""), REMOTE_NONE, REMOTE,
     (403, "M_FORBIDDEN", "remote server cannot create")),
    ("create with a state key", Ev(ROOM, CREATE, ALICE, {}, "x"), NONE, HS, (400, "M_BAD_JSON", "empty state key")),
    ("create without a state key", Ev(ROOM, CREATE, ALICE, {}), NONE, HS, (400, "M_BAD_JSON", "empty state key")),
    # 3. unknown rooms.
    ("local event in an unknown room", msg(ALICE), NONE, HS, (404, "M_NOT_FOUND", "unknown room")),
    ("remote message in an unknown room", msg(RITA, REMOTE_ROOM), REMOTE_NONE, REMOTE,
     (403, "M_FORBIDDEN", "no member")),
    ("remote join in an unknown room", member(RITA, RITA, "join", REMOTE_ROOM), REMOTE_NONE, REMOTE,
     (403, "M_FORBIDDEN", "no member")),
    ("remote invite of a remote user into an unknown room", member(RITA, RON, "invite", REMOTE_ROOM), REMOTE_NONE,
     REMOTE, (403, "M_FORBIDDEN", "no member")),
    ("remote invite of a local user into an unknown room", member(RITA, BOB, "invite", REMOTE_ROOM), REMOTE_NONE,
     REMOTE, VOUCHED),
    ("remote invite into an unknown room of this namespace", member(RITA, BOB, "invite"), NONE, REMOTE,
     (403, "M_FORBIDDEN", "no member")),
    ("remote event in a room every local user left", msg(RITA), room({ALICE: "leave", RITA: "join"}), REMOTE,
     (403, "M_FORBIDDEN", "no member")),
    ("remote re-invite into a room every local user left", member(RITA, ALICE, "invite"),
     room({ALICE: "leave", RITA: "join"}), REMOTE, OK),
    # 4. the sender.
    ("joined sender", msg(BOB), room(), HS, OK),
    ("invited sender", msg(CAROL), room(), HS, (403, "M_FORBIDDEN", "not joined")),
    ("stranger", msg(DAVE), room(), HS, (403, "M_FORBIDDEN", "not joined")),
    ("unknown sender from the room's own server", msg(RON, REMOTE_ROOM), LEARNED, REMOTE, VOUCHED),
    ("unknown remote sender in a room of this server", msg(RON), room(), REMOTE, (403, "M_FORBIDDEN", "not joined")),
    ("unknown sender leaving, from the room's own server", member(RON, RON, "leave", REMOTE_ROOM), LEARNED, REMOTE,
     VOUCHED),
    ("unknown sender leaving, from another server", member(RON, RON, "leave"), room({ALICE: "join", RITA: "join"}),
     REMOTE, (403, "M_FORBIDDEN", "not in room")),
    ("left remote sender from the room's own server", msg(RON, REMOTE_ROOM), room(
        {RON: "leave", BOB: "join"}, room_id=REMOTE_ROOM, creator=""), REMOTE, (403, "M_FORBIDDEN", "not joined")),
    # 5. join.
    ("join of another user", member(BOB, DAVE, "join"), room(), HS, (403, "M_FORBIDDEN", "only join as themselves")),
    ("join without invite, invite-only", member(DAVE, DAVE, "join"), room(), HS, (403, "M_FORBIDDEN", "invite-only")),
    ("join with invite", member(CAROL, CAROL, "join"), room(), HS, OK),
    ("join of a public room", member(DAVE, DAVE, "join"), room(rule=JoinRule.PUBLIC), HS, OK),
    ("join when banned, even public", member(DAVE, DAVE, "join"), room({ALICE: "join", DAVE: "ban"},
                                                                     rule=JoinRule.PUBLIC), HS,
     (403, "M_FORBIDDEN", "banned")),
    ("creator's first join", member(ALICE, ALICE, "join"), room({}), HS, OK),
    ("someone else's first join", member(BOB, BOB, "join"), room({}), HS, (403, "M_FORBIDDEN", "invite-only")),
    ("remote join with invite", member(RITA, RITA, "join"), room({ALICE: "join", RITA: "invite"}), REMOTE, OK),
    ("remote join without invite", member(RITA, RITA, "join"), room({ALICE: "join", RON: "join"}), REMOTE,
     (403, "M_FORBIDDEN", "invite-only")),
    ("remote PDU joining a local user", member(RITA, CAROL, "join"), room({ALICE: "join", RITA: "join"}), REMOTE,
     (403, "M_FORBIDDEN", "only join as themselves")),
    ("local user's join of a learned room, invited", member(BOB, BOB, "join", REMOTE_ROOM), LEARNED, HS, OK),
    # 5. invite.
    ("invite a stranger", member(ALICE, DAVE, "invite"), room(), HS, OK),
    ("invite a joined member (a kick in disguise)", member(ALICE, BOB, "invite"), room(), HS,
     (403, "M_FORBIDDEN", "already joined")),
    ("invite a banned user", member(ALICE, DAVE, "invite"), room({ALICE: "join", DAVE: "ban"}), HS,
     (403, "M_FORBIDDEN", "banned")),
    ("invite by a non-member", member(DAVE, BOB, "invite"), room({ALICE: "join"}), HS,
     (403, "M_FORBIDDEN", "not joined")),
    ("invite below the invite level", member(BOB, DAVE, "invite"),
     room(levels=PowerLevels(users={ALICE: 100}, invite=50)), HS, (403, "M_FORBIDDEN", "inviting needs 50")),
    # 5. leave and kick.
    ("leave oneself", member(BOB, BOB, "leave"), room(), HS, OK),
    ("reject an invite", member(CAROL, CAROL, "leave"), room(), HS, OK),
    ("leave a room one is not in", member(DAVE, DAVE, "leave"), room(), HS, (403, "M_FORBIDDEN", "not in room")),
    ("kick without the kick level", member(BOB, ALICE, "leave"), room(levels=PowerLevels.for_new_room(ALICE)), HS,
     (403, "M_FORBIDDEN", "needs 50")),
    ("kick by the creator", member(ALICE, BOB, "leave"), room(levels=PowerLevels.for_new_room(ALICE)), HS, OK),
    ("kick of an equal", member(BOB, CAROL, "leave"), room(levels=PowerLevels(users={BOB: 50, CAROL: 50})), HS,
     (403, "M_FORBIDDEN", "more than the target's 50")),
    ("kick of someone not in the room", member(ALICE, DAVE, "leave"), room(), HS, (403, "M_FORBIDDEN", "not in room")),
    ("remote PDU leaving a local user", member(RITA, BOB, "leave"), room({ALICE: "join", BOB: "join", RITA: "join"}),
     REMOTE, (403, "M_FORBIDDEN", "needs 50")),
    ("kick by a non-member", member(DAVE, BOB, "leave"), room(levels=PowerLevels(users={DAVE: 100})), HS,
     (403, "M_FORBIDDEN", "not joined")),
    ("unban needs the ban level", member(BOB, DAVE, "leave"),
     room({BOB: "join", DAVE: "ban"}, levels=PowerLevels(users={BOB: 10})), HS, (403, "M_FORBIDDEN", "needs 50")),
    # 5. ban and bad memberships.
    ("ban by the creator", member(ALICE, BOB, "ban"), room(), HS, OK),
    ("ban without the level", member(BOB, ALICE, "ban"), room(), HS, (403, "M_FORBIDDEN", "ban")),
    ("unknown membership", member(BOB, BOB, "knock"), room(), HS, (400, "M_BAD_JSON", "not one of")),
    ("membership of a non-user", member(ALICE, "bob", "invite"), room(), HS, (400, "M_BAD_JSON", "not a user ID")),
    # 6. other state.
    ("state by the creator, no power levels event", Ev(ROOM, "m.room.topic", ALICE, {}, ""), room(), HS, OK),
    ("state by a member, no power levels event", Ev(ROOM, "m.room.topic", BOB, {}, ""), room(), HS, OK),
    ("state below state_default", Ev(ROOM, "m.room.topic", BOB, {}, ""),
     room(levels=PowerLevels.for_new_room(ALICE)), HS, (403, "M_FORBIDDEN", "needs 50")),
    ("a bad join rule", Ev(ROOM, JOIN_RULES, ALICE, {"join_rule": "knock"}, ""), room(), HS,
     (400, "M_BAD_JSON", "public or invite")),
    ("bad power levels", Ev(ROOM, POWER_LEVELS, ALICE, {"kick": "50"}, ""), room(), HS,
     (400, "M_BAD_JSON", "integer")),
    ("power levels by the creator", Ev(ROOM, POWER_LEVELS, ALICE, PowerLevels.for_new_room(ALICE).to_content(), ""),
     room(), HS, OK),
]


class AuthRulesTest(SynchronousTestCase):
    def test_table(self) -> None:
        """Every row of the rule table gets its decision or its refusal (status at the HTTP edge, errcode, reason)."""
        for name, event, view, origin, expected in TABLE:
            if isinstance(expected, Decision):
                self.assertEqual(authorize(event, view, server_name=HS, origin=origin), expected, name)
                continue
            with self.assertRaises(PersistRefused, msg=name) as caught:
                authorize(event, view, server_name=HS, origin=origin)
            code, errcode, part = expected
            self.assertEqual((refusal_status(caught.exception), caught.exception.errcode), (code, errcode), name)
            self.assertIn(part, caught.exception.msg, name)

    def test_apply_tracks_state_for_the_next_event(self) -> None:
        """Accepted events update the view: the join rule, the power levels and memberships decide the next event."""
        view = RoomView(ROOM)
        for event in (Ev(ROOM, CREATE, ALICE, {}, ""), member(ALICE, ALICE, "join"),
                      Ev(ROOM, POWER_LEVELS, ALICE, PowerLevels.for_new_room(ALICE).to_content(), "")):
            apply(event, view, authorize(event, view, server_name=HS, origin=HS))
        self.assertEqual((view.creator, view.members), (ALICE, {ALICE: "join"}))
        self.assertRaises(PersistRefused, authorize, member(BOB, BOB, "join"), view, server_name=HS, origin=HS)
        public = Ev(ROOM, JOIN_RULES, ALICE, {"join_rule": "public"}, "")
        apply(public, view, authorize(public, view, server_name=HS, origin=HS))
        join = member(BOB, BOB, "join")
        apply(join, view, authorize(join, view, server_name=HS, origin=HS))
        self.assertEqual(view.members[BOB], "join")
        self.assertRaises(PersistRefused, authorize, Ev(ROOM, "m.room.topic", BOB, {}, ""), view, server_name=HS, origin=HS)

    def test_vouched_inviter_is_recorded(self) -> None:
        """An accepted invite into an unknown room records the inviter as joined and the invitee as invited."""
        view = RoomView(REMOTE_ROOM)
        invite = member(RITA, BOB, "invite", REMOTE_ROOM)
        apply(invite, view, authorize(invite, view, server_name=HS, origin=REMOTE))
        self.assertEqual(view.members, {RITA: "join", BOB: "invite"})
        self.assertTrue(view.exists and view.has_local_member(HS))
