"""Fuzzing everything that reads untrusted input: nothing crashes, every bad input gets its clear error.

Counts of inputs tried are printed (and asserted) so a run reports how much
was covered: at least 100 000 lines go through the parser and the
connection core.
"""

from __future__ import annotations

import json
import os
import random

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import SynchronousTestCase, TestCase

from synflow.config import load_config
from synflow.errors import ConfigError, ProtocolError, TokenError
from synflow.replication.commands import COMMANDS, Side, parse_line
from synflow.replication.core import Close, ConnectionCore, SendLine
from synflow.tokens import StreamToken
from synflow.tools.client import ApiError, Client, new_pool
from tests.cluster import single_master

LINES_PER_EXAMPLE = 50
FUZZ = settings(max_examples=2_000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

_prefixes = st.sampled_from([*COMMANDS, "", "RDATA events w1 ", "POSITION events w1 ", "USER_SYNC a @u:h "])
_lines = st.one_of(
    st.binary(max_size=120),
    st.builds(lambda p, rest: p.encode() + b" " + rest, _prefixes, st.binary(max_size=80)),
    st.builds(lambda p, rest: (p + " " + rest).encode("utf-8", "surrogatepass"), _prefixes, st.text(max_size=80)),
)
COUNTS = {"parse": 0, "core": 0, "tokens": 0, "config": 0}


class ParserFuzzTest(SynchronousTestCase):
    @FUZZ
    @given(st.lists(_lines, min_size=LINES_PER_EXAMPLE, max_size=LINES_PER_EXAMPLE))
    def test_parse_line(self, lines):
        """Random lines parse or raise ProtocolError; nothing else escapes."""
        for line in lines:
            COUNTS["parse"] += 1
            try:
                parse_line(line)
            except ProtocolError:
                pass

    @FUZZ
    @given(st.sampled_from([Side.SERVER, Side.CLIENT, Side.BOTH]),
           st.lists(_lines, min_size=LINES_PER_EXAMPLE, max_size=LINES_PER_EXAMPLE))
    def test_connection_core(self, side, lines):
        """Random lines into a connection core never raise; a close is preceded by one ERROR."""
        core = ConnectionCore(side, server_name="fuzz", instance_name="w1")
        core.connection_made(0.0)
        closed = False
        for i, line in enumerate(lines):
            COUNTS["core"] += 1
            actions = core.line_received(line.replace(b"\n", b" "), float(i))
            if closed:
                self.assertEqual(actions, [])
            if any(isinstance(a, Close) for a in actions):
                errors = [a for a in actions if isinstance(a, SendLine) and a.data.startswith(b"ERROR ")]
                self.assertEqual(len(errors), 1)
                closed = True

    def test_counts(self):
        """At least 100 000 inputs went through the parser and the core (run after the fuzz tests)."""
        if COUNTS["parse"] < 100_000 or COUNTS["core"] < 100_000:
            # Run standalone: do the work here so the count holds whatever the order.
            self.test_parse_line()
            self.test_connection_core()
        print(f"fuzzed: {COUNTS['parse']} parser inputs, {COUNTS['core']} connection-core inputs")
        self.assertGreaterEqual(COUNTS["parse"], 100_000)
        self.assertGreaterEqual(COUNTS["core"], 100_000)


class TokenFuzzTest(SynchronousTestCase):
    @settings(max_examples=5000, deadline=None, derandomize=True)
    @given(st.one_of(st.text(max_size=60), st.from_regex(r"[sm][0-9~.\-a]{0,40}", fullmatch=True)))
    def test_tokens(self, text):
        """Any text parses to a token that round-trips, or raises TokenError."""
        COUNTS["tokens"] += 1
        try:
            token = StreamToken.parse(text)
        except TokenError:
            return
        self.assertEqual(StreamToken.parse(str(token)), token)


_yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=4),
    max_leaves=10,
)
_keys = st.sampled_from(["server_name", "app", "instance_name", "database", "replication", "instance_map",
                         "stream_writers", "listeners", "federation", "caches", "limits", "audit", "junk"])


class ConfigFuzzTest(SynchronousTestCase):
    @settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(_keys, _yaml_values, max_size=8))
    def test_config(self, data):
        """Random config files load or raise ConfigError, never anything else."""
        COUNTS["config"] += 1
        path = os.path.join(self.mktemp() + ".yaml")
        with open(path, "w") as f:
            yaml.safe_dump(data, f)
        try:
            load_config([path])
        except ConfigError:
            pass


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 6 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 2**70, 1.5, 10**300, -(2**63)])
    if kind == 3:
        return "".join(rng.choice("ab\u00e9\u0000\"\\ 😀") for _ in range(rng.randrange(40)))
    if kind == 4:
        return "x" * rng.choice([0, 10, 70_000])
    if kind == 5:
        return rng.choice(["@u:h", "!r:h", "$e:h", "m.room.message", ""])
    if kind == 6:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["username", "user_id", "body", "origin", "pdus", "edus", "event_id", "room_id", "type", "sender",
            "content", "origin_server_ts", "x"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def _random_body(rng: random.Random) -> bytes:
    choice = rng.randrange(6)
    if choice == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
    if choice == 1:
        return b"[" * rng.randrange(50, 5000) + b"]" * rng.randrange(50)
    if choice == 2:
        return json.dumps(_random_json(rng)).encode()[: rng.randrange(1, 400)]
    return json.dumps(_random_json(rng)).encode()


class HttpFuzzTest(TestCase):
    """Random requests against a real in-process master's client API and inbound federation."""

    timeout = 300
    REQUESTS = 600

    @inlineCallbacks
    def setUp(self):
        self.master, self.url = yield single_master(
            self, "federation: {destinations: {other.test: 'http://127.0.0.1:1'}}\n", server_name="fuzz.test"
        )
        self.pool = new_pool()
        self.addCleanup(self.pool.closeCachedConnections)

    def test_random_requests(self):
        """Random bodies, paths and parameters never get a 500 and never stop the server."""
        return ensureDeferred(self._fuzz())

    async def _fuzz(self):
        rng = random.Random(11)
        user = await Client(self.url, self.pool).register("fuzzer")
        room = await user.create_room()
        anon = Client(self.url, self.pool)
        statuses: dict[int, int] = {}
        paths = [
            ("POST", "/register"), ("POST", "/rooms"), ("POST", f"/rooms/{room}/join"),
            ("POST", f"/rooms/{room}/invite"), ("PUT", f"/rooms/{room}/send/m.fuzz/t"),
            ("PUT", "/rooms/%FF%FE/send/x/y"), ("GET", "/sync?since=m1~2.3&timeout=0"),
            ("GET", "/sync?limit=99999999999999&timeout=0"), ("GET", "/sync?since=%00&timeout=0"),
        ]
        fed = Client(self.url, self.pool)
        for i in range(self.REQUESTS):
            body = _random_body(rng)
            if rng.random() < 0.3:
                fed.base_url = self.url.replace("/_synflow/client/v1", "")
                method, path = "PUT", f"/_matrix/federation/v1/send/fz{i}"
                try:
                    response = await fed.http.request(method, self.url + path, data=body, timeout=30)
                    await response.content()
                    code = response.code
                except Exception as e:
                    self.fail(f"federation request {i} failed at the transport: {e!r}")
            else:
                method, path = rng.choice(paths)
                if "send" in path:
                    path += str(i)
                client = user if rng.random() < 0.8 else anon
                try:
                    await client.request(method, path, raw=body)
                    code = 200
                except ApiError as e:
                    code = e.code
                    self.assertIsInstance(e.body, dict, f"{method} {path}: non-JSON error body")
                    self.assertIn("errcode", e.body)
            statuses[code] = statuses.get(code, 0) + 1
            self.assertNotEqual(code, 500, f"request {i} ({method} {path}) got 500")
        print(f"fuzzed {self.REQUESTS} HTTP requests: statuses {sorted(statuses.items())}")
        await user.send(room, {"body": "still alive"}, "final")
