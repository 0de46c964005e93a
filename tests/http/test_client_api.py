"""The client API on one real in-process master (SQLite, real HTTP on loopback)."""

from __future__ import annotations

from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.tools.client import ApiError, Client, new_pool
from tests.cluster import single_master


def _as_deferred(f):
    def wrapper(self, *a, **kw):
        return ensureDeferred(f(self, *a, **kw))

    wrapper.__name__ = f.__name__
    wrapper.__doc__ = f.__doc__
    return wrapper


class _ApiTestBase(TestCase):
    timeout = 60
    extra = ""

    @inlineCallbacks
    def setUp(self):
        self.master, self.url = yield single_master(self, self.extra)
        self.pool = new_pool()
        self.addCleanup(self.pool.closeCachedConnections)

    def client(self, token=None):
        return Client(self.url, self.pool, token)

    async def assertApiError(self, code, errcode, coro):
        try:
            await coro
        except ApiError as e:
            self.assertEqual((e.code, e.errcode), (code, errcode), e.body)
            self.assertIsInstance(e.body.get("error"), str)
            return e
        self.fail(f"expected {code} {errcode}")


class ClientApiTest(_ApiTestBase):

    @_as_deferred
    async def test_register_create_send_sync(self):
        """A registered user creates a room, sends, and syncs the events back in order."""
        alice = await self.client().register("alice")
        self.assertEqual(alice.user_id, "@alice:api.test")
        room = await alice.create_room()
        self.assertTrue(room.startswith("!") and room.endswith(":api.test"))
        sent = [await alice.send(room, {"body": f"m{i}"}, f"t{i}") for i in range(5)]
        result = await alice.sync()
        bodies = [e["content"].get("body") for e in result["events"] if e["type"] == "m.room.message"]
        self.assertEqual(bodies, [f"m{i}" for i in range(5)])
        self.assertEqual([e["event_id"] for e in result["events"]][-5:], [s["event_id"] for s in sent])
        again = await alice.sync(since=result["next_batch"])
        self.assertEqual(again["events"], [])
        self.assertFalse(result["limited"])

    @_as_deferred
    async def test_send_is_idempotent(self):
        """Sending twice with one txn_id returns the same event and persists it once."""
        alice = await self.client().register("alice")
        room = await alice.create_room()
        first = await alice.send(room, {"body": "once"}, "txn1")
        second = await alice.send(room, {"body": "once"}, "txn1")
        self.assertEqual(first["event_id"], second["event_id"])
        events = (await alice.sync())["events"]
        self.assertEqual(sum(1 for e in events if e["event_id"] == first["event_id"]), 1)

    @_as_deferred
    async def test_sync_limit_and_chain(self):
        """A limited sync returns the oldest events and a token from which the rest follow, none twice."""
        alice = await self.client().register("alice")
        room = await alice.create_room()
        ids = [(await alice.send(room, {"n": i}, f"t{i}"))["event_id"] for i in range(12)]
        seen, since = [], None
        for _ in range(10):
            result = await alice.sync(since=since, limit=5)
            seen += [e["event_id"] for e in result["events"]]
            since = result["next_batch"]
            if not result["limited"]:
                break
        self.assertEqual(seen[-12:], ids)
        self.assertEqual(len(seen), len(set(seen)))

    @_as_deferred
    async def test_long_poll_wakes_on_event(self):
        """A sync with a timeout returns as soon as an event arrives in the user's room."""
        alice = await self.client().register("alice")
        room = await alice.create_room()
        start = (await alice.sync())["next_batch"]
        poll = ensureDeferred(alice.sync(since=start, timeout_ms=20_000))
        sent = await alice.send(room, {"body": "wake"}, "t1")
        result = await poll
        self.assertEqual([e["event_id"] for e in result["events"]], [sent["event_id"]])

    @_as_deferred
    async def test_send_token_returns_the_event(self):
        """A sync from a send's token returns that event first."""
        alice = await self.client().register("alice")
        room = await alice.create_room()
        sent = await alice.send(room, {"body": "x"}, "t1")
        result = await alice.sync(since=sent["token"], timeout_ms=5000)
        self.assertEqual(result["events"][0]["event_id"], sent["event_id"])

    @_as_deferred
    async def test_error_statuses(self):
        """Each client error gets its status and errcode, and the server keeps serving."""
        anon = self.client()
        alice = await self.client().register("alice")
        bob = await self.client().register("bob")
        room = await alice.create_room()
        await self.assertApiError(409, "M_USER_IN_USE", anon.register("alice"))
        await self.assertApiError(400, "M_INVALID_USERNAME", anon.register("Bad Name!"))
        await self.assertApiError(400, "M_NOT_JSON", anon.request("POST", "/register", raw=b"{not json"))
        await self.assertApiError(400, "M_NOT_JSON", anon.request("POST", "/register", raw=b"\xff\xfe"))
        await self.assertApiError(400, "M_BAD_JSON", anon.request("POST", "/register", raw=b"[1]"))
        deep = b'{"a": ' + b"[" * 70 + b"]" * 70 + b"}"
        await self.assertApiError(400, "M_BAD_JSON", alice.request("PUT", f"/rooms/{room}/send/m.x/deep", raw=deep))
        await self.assertApiError(401, "M_MISSING_TOKEN", anon.sync())
        await self.assertApiError(401, "M_UNKNOWN_TOKEN", self.client("nope").sync())
        await self.assertApiError(403, "M_FORBIDDEN", bob.send(room, {"body": "hi"}, "t1"))
        await self.assertApiError(404, "M_NOT_FOUND", alice.send("!missing:api.test", {"body": "hi"}, "t2"))
        await self.assertApiError(400, "M_TOO_LARGE", alice.send(room, {"body": "x" * 70_000}, "t3"))
        await self.assertApiError(413, "M_TOO_LARGE", alice.send(room, {"body": "x" * 1_100_000}, "t4"))
        for bad in ("", "m", "mx", "s-1", "m1~a.2", "m5~999.9", "s99999999999999999999", "t1-2"):
            await self.assertApiError(400, "M_INVALID_PARAM", alice.sync(since=bad))
        await self.assertApiError(400, "M_INVALID_PARAM", alice.request("GET", "/sync?timeout=-5"))
        await self.assertApiError(404, "M_UNRECOGNIZED", alice.request("GET", "/nothing/here"))
        await self.assertApiError(405, "M_UNRECOGNIZED", alice.request("GET", "/register"))
        # Still serving after all that.
        await bob.join(room)
        await bob.send(room, {"body": "now allowed"}, "t5")

    @_as_deferred
    async def test_leave_stops_delivery(self):
        """After leaving a room a user gets no more of its events, and cannot send to it."""
        alice = await self.client().register("alice")
        bob = await self.client().register("bob")
        room = await alice.create_room()
        await bob.join(room)
        since = (await bob.sync())["next_batch"]
        await bob.leave(room)
        await alice.send(room, {"body": "after"}, "t1")
        result = await bob.sync(since=since)
        self.assertNotIn("after", [e["content"].get("body") for e in result["events"]])
        await self.assertApiError(403, "M_FORBIDDEN", bob.send(room, {"body": "x"}, "t2"))


class RateLimitTest(_ApiTestBase):
    extra = "limits: {rate_limit_per_s: 0.001, rate_limit_burst: 3}\n"

    @_as_deferred
    async def test_rate_limit(self):
        """Past the configured burst a user's requests get 429 M_LIMIT_EXCEEDED."""
        alice = await self.client().register("alice")
        room = await alice.create_room()
        await alice.send(room, {}, "t1")
        await alice.send(room, {}, "t2")
        await self.assertApiError(429, "M_LIMIT_EXCEEDED", alice.send(room, {}, "t3"))
