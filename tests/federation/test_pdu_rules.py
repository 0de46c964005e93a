"""Remote PDUs under the room rules and field bounds, on one real in-process master (SQLite, real HTTP).

PDUs go in through the master's inbound transaction handler with an
authenticated origin (what ``/send`` hands it once the request's origin is
verified); clients act through the real client API.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.events.bounds import MAX_ID_BYTES, MAX_PDU_BYTES, MAX_SAFE_INTEGER
from synflow.tools.client import Client, new_pool
from tests.cluster import single_master

HS = "api.test"
EVIL = "evil.test"
MALLORY = f"@mallory:{EVIL}"
_ids = itertools.count()


def _as_deferred(f: Any) -> Any:
    def wrapper(self: Any, *a: Any, **kw: Any) -> Any:
        return ensureDeferred(f(self, *a, **kw))

    wrapper.__name__ = f.__name__
    wrapper.__doc__ = f.__doc__
    return wrapper


def pdu(room: str, sender: str, event_type: str = "m.room.message", content: dict[str, Any] | None = None,
        state_key: str | None = None, **extra: Any) -> dict[str, Any]:
    p: dict[str, Any] = {"event_id": f"$p{next(_ids)}:{sender.partition(':')[2]}", "room_id": room,
                         "type": event_type, "sender": sender, "content": {"body": "hi"} if content is None else content,
                         "origin_server_ts": 1_000, "prev_events": [], "depth": 1}
    if state_key is not None:
        p["state_key"] = state_key
    p.update(extra)
    return p


def membership(room: str, sender: str, target: str, value: str) -> dict[str, Any]:
    return pdu(room, sender, "m.room.member", {"membership": value}, target)


#: One bad field of a PDU, as (field, value); values that JSON cannot carry are written into the body by hand.
_BAD_FIELDS = st.one_of(
    st.tuples(st.sampled_from(["depth", "origin_server_ts"]),
              st.one_of(st.integers(min_value=MAX_SAFE_INTEGER + 1), st.integers(max_value=-MAX_SAFE_INTEGER - 1))),
    st.tuples(st.just("content"), st.builds(lambda k, v: {k: v}, st.text(min_size=1, max_size=5),
                                            st.sampled_from(["__INF__", "__NINF__", "__BIG__"]))),
    st.tuples(st.sampled_from(["type", "state_key", "event_id"]),
              st.text(alphabet="xé\U0001f600", min_size=1, max_size=4).map(lambda t: (t * 200)[:MAX_ID_BYTES + 1])
              .filter(lambda t: len(t.encode()) > MAX_ID_BYTES)),
    st.tuples(st.sampled_from(["type", "content"]), st.sampled_from(["\ud800", "a\udfff"])),
    st.tuples(st.just("content"), st.integers(1, 3).map(lambda n: {"pad": "x" * (MAX_PDU_BYTES * n)})),
)


def _encode(body: dict[str, Any]) -> bytes:
    """JSON with ``__INF__``/``__NINF__``/``__BIG__`` markers made into ``1e999``, ``-1e999`` and ``1e400`` numbers."""
    text = json.dumps(body)
    for marker, number in (('"__INF__"', "1e999"), ('"__NINF__"', "-1e999"), ('"__BIG__"', "1e400")):
        text = text.replace(marker, number)
    return text.encode()


def _generated_bad_fields(n: int) -> list[tuple[str, Any]]:
    """``n`` bad fields drawn by hypothesis (generation only: each is replayed against the real master)."""
    drawn: list[tuple[str, Any]] = []

    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(_BAD_FIELDS)
    def collect(field: tuple[str, Any]) -> None:
        drawn.append(field)

    collect()
    return drawn


class PduRulesTest(TestCase):
    timeout = 120

    @inlineCallbacks
    def setUp(self) -> Any:
        self.master, self.url = yield single_master(self, f"federation: {{allowed_origins: [{EVIL}, third.test]}}\n")
        self.pool = new_pool()
        self.addCleanup(self.pool.closeCachedConnections)
        self.inbound = self.master.worker.federation_inbound
        self.store = self.master.worker.store

    async def send(self, origin: str, *pdus: dict[str, Any], raw: bytes | None = None) -> dict[str, Any]:
        """Deliver one transaction as ``origin``; returns the per-PDU results."""
        body = raw if raw is not None else _encode({"origin": origin, "origin_server_ts": 1, "pdus": list(pdus)})
        code, reply = await self.inbound.on_send(origin, f"t{next(_ids)}", body)
        self.assertEqual(code, 200, reply)
        results: dict[str, Any] = reply["pdus"]
        return results

    async def users(self, *names: str) -> list[Client]:
        return [await Client(self.url, self.pool).register(n) for n in names]

    @_as_deferred
    async def test_remote_pdus_cannot_move_local_users(self) -> None:
        """A remote server cannot leave or join this server's users, nor speak for them, even once in the room."""
        alice, bob, carol = await self.users("alice", "bob", "carol")
        room = await alice.create_room()
        await alice.invite(room, bob.user_id)
        await bob.join(room)
        await alice.invite(room, MALLORY)
        joined = membership(room, MALLORY, MALLORY, "join")
        self.assertEqual(await self.send(EVIL, joined), {joined["event_id"]: {}})  # invited: a legitimate join
        attacks = [
            membership(room, MALLORY, bob.user_id, "leave"),  # kick without the power level
            membership(room, MALLORY, carol.user_id, "join"),  # join someone else
            membership(room, carol.user_id, carol.user_id, "join"),  # speak for a local user
            membership(room, MALLORY, alice.user_id, "ban"),
            membership(room, MALLORY, bob.user_id, "invite"),  # an invite as a kick
        ]
        results = await self.send(EVIL, *attacks)
        for attack in attacks:
            self.assertIn("error", results[attack["event_id"]], attack)
        self.assertEqual((await alice.members(room))["members"], sorted([alice.user_id, bob.user_id, MALLORY]))
        self.assertEqual(await self.store.get_membership(room, carol.user_id), None)

    @_as_deferred
    async def test_pdus_for_rooms_without_local_members_are_refused(self) -> None:
        """A PDU for an unknown room creates nothing; one for a room evil has no member in changes nothing."""
        alice, bob = await self.users("alice", "bob")
        room = await alice.create_room()
        unknown = f"!new:{EVIL}"
        attacks = [pdu(unknown, MALLORY), membership(unknown, MALLORY, MALLORY, "join"),
                   membership(room, MALLORY, MALLORY, "join"), membership(room, MALLORY, bob.user_id, "join"),
                   membership(room, MALLORY, alice.user_id, "leave"), pdu(room, MALLORY)]
        results = await self.send(EVIL, *attacks)
        self.assertTrue(all("error" in results[a["event_id"]] for a in attacks), results)
        self.assertFalse(await self.store.room_exists(unknown))
        self.assertEqual((await alice.members(room))["members"], [alice.user_id])
        events = (await alice.sync())["events"]
        self.assertFalse([e for e in events if e["sender"] == MALLORY])

    @_as_deferred
    async def test_an_invite_makes_this_server_a_participant(self) -> None:
        """A remote invite of a local user is accepted; the user joins through this server and the room's server's PDUs follow."""
        (bob,) = await self.users("bob")
        room = f"!shared:{EVIL}"
        invite = membership(room, MALLORY, bob.user_id, "invite")
        self.assertEqual(await self.send(EVIL, invite), {invite["event_id"]: {}})
        await bob.join(room)
        joined = await self.master.db.run_interaction("read", lambda txn: (txn.execute(
            "SELECT destinations FROM events WHERE room_id = ? AND sender = ?", (room, bob.user_id)), txn.fetchall())[1])
        self.assertEqual([json.loads(d) for (d,) in joined], [[EVIL]])  # the join goes back to the room's server
        from_inviter, from_other = pdu(room, MALLORY), pdu(room, f"@other:{EVIL}")  # other joined before we came
        intruder = pdu(room, "@x:third.test")  # a third server's user this server never saw join
        self.assertEqual(await self.send(EVIL, from_inviter, from_other),
                         {from_inviter["event_id"]: {}, from_other["event_id"]: {}})
        self.assertIn("error", (await self.send("third.test", intruder))[intruder["event_id"]])
        seen = [e["event_id"] for e in (await bob.sync())["events"]]
        self.assertEqual([e for e in seen if e in (from_inviter["event_id"], from_other["event_id"],
                                                     intruder["event_id"])],
                         [from_inviter["event_id"], from_other["event_id"]])

    @_as_deferred
    async def test_bad_pdus_are_refused_alone(self) -> None:
        """Hypothesis-drawn PDUs with out-of-range, non-finite, over-long or invalid-UTF-8 fields are each refused alone; the rest of the batch persists; sync keeps answering."""
        (bob,) = await self.users("bob")
        room = f"!bounds:{EVIL}"
        await self.send(EVIL, membership(room, MALLORY, bob.user_id, "invite"))
        await bob.join(room)
        since = (await bob.sync())["next_batch"]
        for n, (field, value) in enumerate(_generated_bad_fields(25)):
            bad = pdu(room, MALLORY)
            bad["content"] = {"n": n}
            if field == "content" and isinstance(value, dict):
                bad["content"].update(value)
            else:
                bad[field] = value
            good = [pdu(room, MALLORY, content={"body": f"{n}-{i}"}) for i in range(2)]
            results = await self.send(EVIL, good[0], bad, good[1])
            bad_id = bad["event_id"]
            self.assertIn("error", results.get(bad_id, {}), (field, value, results))
            self.assertEqual([results[g["event_id"]] for g in good], [{}, {}], (field, value))
            reply = await bob.sync(since=since)
            since = reply["next_batch"]
            self.assertEqual([e["content"].get("body") for e in reply["events"]], [f"{n}-0", f"{n}-1"], (field, value))
