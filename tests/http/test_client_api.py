"""The client API on one real in-process master (SQLite, real HTTP on loopback)."""

from __future__ import annotations

import glob
import hashlib
import os
import time
from urllib.parse import quote

from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.tools.client import ApiError, Client, new_pool
from tests.cluster import read_jsonl, single_master


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
    async def test_sync_returns_content_as_sent(self):
        """Sync splices each event's stored content text into its response: any content comes back equal, the
        room's state events with their state keys."""
        alice = await self.client().register("alice")
        room = await alice.create_room()
        content = {"body": 'caf\u00e9 "quoted" \\ \u2028 \U0001f600 \x01', "n": [1, -2.5, None, True, {"k": []}]}
        sent = await alice.send(room, content, "t-unicode")
        result = await alice.sync()
        by_id = {e["event_id"]: e for e in result["events"]}
        self.assertEqual(by_id[sent["event_id"]]["content"], content)
        self.assertNotIn("state_key", by_id[sent["event_id"]])
        self.assertIn("", [e.get("state_key") for e in result["events"] if e["type"] == "m.room.create"])
        self.assertTrue(all(isinstance(e["origin_server_ts"], int) for e in result["events"]))

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
        await self.assertApiError(413, "M_TOO_LARGE", alice.request("POST", "/register", raw=b" " * 1_100_000))
        for bad in ("", "m", "mx", "s-1", "m1~a.2", "m5~999.9", "s99999999999999999999", "t1-2"):
            await self.assertApiError(400, "M_INVALID_PARAM", alice.sync(since=bad))
        await self.assertApiError(400, "M_INVALID_PARAM", alice.request("GET", "/sync?timeout=-5"))
        await self.assertApiError(404, "M_UNRECOGNIZED", alice.request("GET", "/nothing/here"))
        await self.assertApiError(405, "M_UNRECOGNIZED", alice.request("GET", "/register"))
        # Still serving after all that.
        await alice.invite(room, bob.user_id)
        await bob.join(room)
        await bob.send(room, {"body": "now allowed"}, "t5")

    @_as_deferred
    async def test_event_size_limits(self):
        """Content whose event fits in 65,536 bytes is accepted; 64 KiB of content (an event over 65,536 bytes) up to the 1 MiB request limit gets 400, past that 413."""

        def body(size: int) -> bytes:
            raw = b'{"body":"' + b"x" * (size - 11) + b'"}'
            assert len(raw) == size
            return raw

        alice = await self.client().register("alice")
        room = await alice.create_room()
        path = f"/rooms/{quote(room)}/send/m.room.message"
        sent = await alice.request("PUT", f"{path}/fits", raw=body(64 * 1024 - 1024))
        for i, size in enumerate((64 * 1024, 64 * 1024 + 1, 65 * 1024, 512 * 1024, 1024 * 1024)):
            error = await self.assertApiError(400, "M_TOO_LARGE", alice.request("PUT", f"{path}/big{i}", raw=body(size)))
            self.assertIn("65536", error.body["error"])
        for i, size in enumerate((1024 * 1024 + 1, 2 * 1024 * 1024)):
            await self.assertApiError(413, "M_TOO_LARGE", alice.request("PUT", f"{path}/huge{i}", raw=body(size)))
        events = (await alice.sync())["events"]
        self.assertEqual([e["event_id"] for e in events if e["type"] == "m.room.message"], [sent["event_id"]])
        self.assertEqual(len(events[-1]["content"]["body"]), 64 * 1024 - 1024 - 11)

    @_as_deferred
    async def test_access_tokens_stored_hashed(self):
        """Registration stores the access token's SHA-256, never the token itself, in the table or the database files."""
        alice = await self.client().register("alice")
        bob = await self.client().register("bob")
        rows = await self.master.db.run_interaction(
            "read_tokens", lambda txn: (txn.execute("SELECT * FROM access_tokens"), txn.fetchall())[1])
        self.assertEqual(len(rows), 2)
        for client in (alice, bob):
            self.assertNotIn(client.token, repr(rows))
            digest = hashlib.sha256(client.token.encode("utf-8")).hexdigest()
            self.assertEqual(sum(1 for row in rows if digest in row and client.user_id in row), 1)
        database = self.master.config.database_path
        for path in glob.glob(database + "*"):
            with open(path, "rb") as f:
                data = f.read()
            self.assertNotIn(alice.token.encode(), data, path)
        self.assertTrue(glob.glob(database + "*"))
        # The token still authenticates.
        await alice.sync()

    @_as_deferred
    async def test_token_audit_records(self):
        """Every sync appends one token record matching its response, and the instance map is written alongside."""
        alice = await self.client().register("alice")
        room = await alice.create_room()
        for i in range(3):
            await alice.send(room, {"n": i}, f"a{i}")
        responses, windows = [], []

        async def sync(**kwargs):
            before = int(time.time() * 1_000_000)
            response = await alice.sync(**kwargs)
            windows.append((before, int(time.time() * 1_000_000)))
            responses.append((kwargs, response))
            return response

        first = await sync()
        for i in range(3, 7):
            await alice.send(room, {"n": i}, f"a{i}")
        second = await sync(since=first["next_batch"], device_id="PHONE", limit=2)
        third = await sync(since=second["next_batch"], device_id="PHONE")
        await sync(since=third["next_batch"])
        self.assertTrue(second["limited"])
        self.master.audit.flush()
        audit_dir = self.master.config.audit_dir
        records = [r for path in sorted(glob.glob(os.path.join(audit_dir, "token_logs", "master", "*.jsonl")))
                   for r in read_jsonl(path)]
        self.assertEqual(len(records), len(responses))
        for record, (kwargs, response), (before, after) in zip(records, responses, windows, strict=True):
            reader = f"{alice.user_id}/{kwargs['device_id']}" if "device_id" in kwargs else alice.user_id
            self.assertEqual(record["reader"], reader)
            self.assertEqual(record["stream"], "events")
            self.assertEqual(record["since"], kwargs.get("since"))
            self.assertEqual(record["token"], response["next_batch"])
            self.assertIs(type(record["issued_at"]), int)
            self.assertTrue(before <= record["issued_at"] <= after, (before, record["issued_at"], after))
            self.assertEqual(record["issued_by"], "master")
            self.assertEqual(record["delivered"], [e["event_id"] for e in response["events"]])
        self.assertEqual([r["reader"] for r in records],
                         ["@alice:api.test", "@alice:api.test/PHONE", "@alice:api.test/PHONE", "@alice:api.test"])
        self.assertEqual(len(records[1]["delivered"]), 2)
        # The instance map rows the tokens' instance IDs refer to.
        mapped = read_jsonl(os.path.join(audit_dir, "instance_map", "master.jsonl"))
        in_db = await self.master.db.run_interaction(
            "read_instances",
            lambda txn: (txn.execute("SELECT instance_id, instance_name FROM instance_map"), txn.fetchall())[1])
        self.assertEqual(sorted((r["instance_id"], r["instance_name"]) for r in mapped), sorted(in_db))
        self.assertIn("master", [r["instance_name"] for r in mapped])
        self.assertTrue(all(set(r) == {"instance_id", "instance_name"} for r in mapped))

    @_as_deferred
    async def test_leave_stops_delivery(self):
        """After leaving a room a user gets no more of its events, and cannot send to it."""
        alice = await self.client().register("alice")
        bob = await self.client().register("bob")
        room = await alice.create_room()
        await alice.invite(room, bob.user_id)
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
