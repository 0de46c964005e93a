"""Membership rules and send idempotency through the client API, on one real in-process master."""

from __future__ import annotations

from urllib.parse import quote

from twisted.internet.defer import ensureDeferred

from synflow.tools.client import ApiError
from tests.http.test_client_api import _ApiTestBase, _as_deferred


class RoomRulesTest(_ApiTestBase):

    async def members(self, client, room):
        return (await client.members(room))["members"]

    @_as_deferred
    async def test_join_needs_an_invite_unless_public(self):
        """A user who learns a room's ID cannot join an invite-only room (the default); an invite or public_chat lets them."""
        alice = await self.client().register("alice")
        bob = await self.client().register("bob")
        private, public = await alice.create_room(), await alice.create_room(preset="public_chat")
        await self.assertApiError(403, "M_FORBIDDEN", bob.join(private))
        await self.assertApiError(403, "M_FORBIDDEN", bob.send(private, {"body": "x"}, "t1"))
        self.assertEqual(await self.members(alice, private), [alice.user_id])
        await bob.join(public)
        self.assertEqual(await self.members(alice, public), sorted([alice.user_id, bob.user_id]))
        await alice.invite(private, bob.user_id)
        await bob.join(private)
        self.assertEqual(await self.members(alice, private), sorted([alice.user_id, bob.user_id]))
        explicit = await alice.request("POST", "/rooms", {"preset": "private_chat"})
        await self.assertApiError(403, "M_FORBIDDEN", bob.join(explicit["room_id"]))
        visible = await alice.request("POST", "/rooms", {"visibility": "public"})
        await bob.join(visible["room_id"])
        for bad in ({"preset": "trusted_private_chat"}, {"visibility": "everyone"}, {"preset": 3}):
            await self.assertApiError(400, "M_INVALID_PARAM", alice.request("POST", "/rooms", bad))

    @_as_deferred
    async def test_invite_cannot_kick_and_kick_needs_power(self):
        """Inviting a joined member is refused and leaves them joined; only a user with the kick level removes another."""
        alice = await self.client().register("alice")
        bob = await self.client().register("bob")
        carol = await self.client().register("carol")
        room = await alice.create_room()
        for user in (bob, carol):
            await alice.invite(room, user.user_id)
            await user.join(room)
        await self.assertApiError(403, "M_FORBIDDEN", bob.invite(room, carol.user_id))
        await self.assertApiError(403, "M_FORBIDDEN", alice.invite(room, bob.user_id))
        await self.assertApiError(403, "M_FORBIDDEN", bob.kick(room, carol.user_id))  # power 0 < kick 50
        self.assertEqual(await self.members(alice, room), sorted([alice.user_id, bob.user_id, carol.user_id]))
        await alice.kick(room, carol.user_id)
        self.assertEqual(await self.members(alice, room), sorted([alice.user_id, bob.user_id]))
        await self.assertApiError(403, "M_FORBIDDEN", carol.join(room))  # a kicked user needs a new invite

    @_as_deferred
    async def test_members_needs_membership(self):
        """GET members answers 403 to a user not joined to the room (never invited, invited, or left)."""
        alice = await self.client().register("alice")
        bob = await self.client().register("bob")
        room = await alice.create_room()
        await self.assertApiError(403, "M_FORBIDDEN", bob.members(room))
        await alice.invite(room, bob.user_id)
        await self.assertApiError(403, "M_FORBIDDEN", bob.members(room))
        await bob.join(room)
        self.assertEqual(await self.members(bob, room), sorted([alice.user_id, bob.user_id]))
        await bob.leave(room)
        await self.assertApiError(403, "M_FORBIDDEN", bob.members(room))

    @_as_deferred
    async def test_create_only_through_create_room(self):
        """PUT send/m.room.create is refused for an existing room, a new local ID and another server's namespace; nothing is created."""
        alice = await self.client().register("alice")
        room = await alice.create_room()
        for target in (room, "!new:api.test", "!theirs:other.test"):
            await self.assertApiError(403, "M_FORBIDDEN", alice.send(target, {"creator": alice.user_id}, "c1",
                                                                     event_type="m.room.create"))
        for target in ("!new:api.test", "!theirs:other.test"):
            self.assertFalse(await self.master.worker.store.room_exists(target))
            await self.assertApiError(404, "M_NOT_FOUND", alice.send(target, {"body": "x"}, "m1"))
        state = (await alice.request("GET", f"/rooms/{quote(room)}/state"))["state"]
        self.assertEqual(len(state["m.room.create"]), 1)

    @_as_deferred
    async def test_one_txn_id_in_ten_rooms_is_ten_sends(self):
        """One transaction ID sent to ten rooms makes ten events; repeating a request returns its event; another type is a new send."""
        alice = await self.client().register("alice")
        rooms = [await alice.create_room() for _ in range(10)]
        first = [await alice.send(room, {"body": room}, "same-txn") for room in rooms]
        self.assertEqual(len({r["event_id"] for r in first}), 10)
        again = [await alice.send(room, {"body": room}, "same-txn") for room in rooms]
        self.assertEqual([r["event_id"] for r in again], [r["event_id"] for r in first])
        other_type = await alice.send(rooms[0], {"body": "x"}, "same-txn", event_type="m.room.other")
        self.assertNotIn(other_type["event_id"], {r["event_id"] for r in first})
        events = (await alice.sync())["events"]
        stored = [e for e in events if e["type"] == "m.room.message"]
        self.assertEqual(sorted(e["room_id"] for e in stored), sorted(rooms))
        self.assertEqual({e["room_id"]: e["content"]["body"] for e in stored}, {r: r for r in rooms})

    @_as_deferred
    async def test_txn_ids_are_per_device(self):
        """Another user's (so another device's) same transaction ID in the same room is a send of its own."""
        alice = await self.client().register("alice")
        bob = await self.client().register("bob")
        room = await alice.create_room(preset="public_chat")
        await bob.join(room)
        a = await alice.send(room, {"body": "a"}, "t")
        b = await bob.send(room, {"body": "b"}, "t")
        self.assertNotEqual(a["event_id"], b["event_id"])

    @_as_deferred
    async def test_out_of_bounds_content_is_refused_and_sync_keeps_answering(self):
        """A send with an out-of-range integer, Infinity or a type over 255 bytes is refused alone; sync still answers."""
        alice = await self.client().register("alice")
        room = await alice.create_room()
        for i, raw in enumerate((b'{"n": 9007199254740992}', b'{"n": -9007199254740992}', b'{"n": 1e999}')):
            path = f"/rooms/{quote(room)}/send/m.room.message/bad{i}"
            try:
                await alice.request("PUT", path, raw=raw)
            except ApiError as e:
                self.assertEqual(e.code, 400, e.body)
                self.assertIn(e.errcode, ("M_BAD_JSON", "M_NOT_JSON"))
            else:
                self.fail(f"{raw!r} was accepted")
        await self.assertApiError(400, "M_BAD_JSON", alice.send(room, {"body": "x"}, "long", event_type="é" * 128))
        ok = await alice.send(room, {"body": "fine"}, "good")
        events = (await ensureDeferred(alice.sync()))["events"]
        self.assertEqual([e["event_id"] for e in events if e["type"] == "m.room.message"], [ok["event_id"]])
