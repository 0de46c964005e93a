"""The client API's cached room-state read on one in-process master."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.tools.client import ApiError, Client, new_pool
from tests.caching.stores import sample
from tests.cluster import single_master


class StateApiTest(TestCase):
    timeout = 60

    @inlineCallbacks
    def setUp(self) -> Any:
        self.master, self.url = yield single_master(self)
        self.pool = new_pool()
        self.addCleanup(self.pool.closeCachedConnections)

    async def assert_state_refused(self, client: Client, room: str, served: str) -> None:
        """GET state of ``room`` as ``client`` answers 403; if it is served, fail saying ``served``."""
        try:
            await client.request("GET", f"/rooms/{room}/state")
        except ApiError as e:
            self.assertEqual(e.code, 403)
        else:
            self.fail(served)

    def test_state_follows_membership_changes(self) -> Any:
        """GET state is served from the room-state cache and shows each join and leave; non-members get 403."""
        return ensureDeferred(self._state_follows_membership_changes())

    async def _state_follows_membership_changes(self) -> None:
        alice = await Client(self.url, self.pool).register("alice")
        bob = await Client(self.url, self.pool).register("bob")
        room = await alice.create_room()
        first = await alice.request("GET", f"/rooms/{room}/state")
        self.assertEqual(sorted(first["state"]), ["m.room.create", "m.room.join_rules", "m.room.member",
                                                  "m.room.power_levels"])
        self.assertEqual(sorted(first["state"]["m.room.member"]), [alice.user_id])
        hits = sample("synflow_cache_hits_total", cache="get_current_state_ids")
        again = await alice.request("GET", f"/rooms/{room}/state")
        self.assertEqual(again["state"], first["state"])
        self.assertEqual(sample("synflow_cache_hits_total", cache="get_current_state_ids") - hits, 1)
        await self.assert_state_refused(bob, room, "a non-member read the room's state")
        await alice.invite(room, bob.user_id)
        await bob.join(room)
        joined = await bob.request("GET", f"/rooms/{room}/state")
        self.assertEqual(sorted(joined["state"]["m.room.member"]), sorted([alice.user_id, bob.user_id]))
        await alice.leave(room)
        after = await bob.request("GET", f"/rooms/{room}/state")
        leave_id = after["state"]["m.room.member"][alice.user_id]
        self.assertNotEqual(leave_id, joined["state"]["m.room.member"][alice.user_id])
        await self.assert_state_refused(alice, room, "a user who left could still read the room's state")
