"""Fuzzing everything that reads untrusted input: nothing crashes, every bad input gets its clear error.

Counts of inputs tried are printed (and asserted) so a run reports how much
was covered: at least 100 000 lines go through the parser, and at least
100 000 lines each reach an *open* connection core (a core that closes is
replaced by a new one, half of them already past the handshake).
"""

from __future__ import annotations

import json
import os
import random
from urllib.parse import quote

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from signedjson.key import generate_signing_key
from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import SynchronousTestCase, TestCase

from synflow.config import load_config
from synflow.errors import ConfigError, ProtocolError, TokenError
from synflow.federation.keys import public_key_base64
from synflow.federation.signing import auth_header
from synflow.replication.commands import COMMANDS, Side, may_send, parse_line
from synflow.replication.core import Close, ConnectionCore, Deliver, SendLine, State
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
#: Well-formed lines of every command, so that fuzzed cores also get past the handshake.
_VALID_LINES = st.sampled_from([
    b"PING 1700000000000", b"REPLICATE", b"REPLICATE ", b"NAME w2", b"SERVER fuzz", b"ERROR oops",
    b"POSITION events w2 1 5", b'RDATA events w2 5 ["$e:h","!r:h","m.room.message",null,"@u:h",null]',
    b'RDATA events w2 batch ["$e:h","!r:h","m.room.message",null,"@u:h",null]', b"RDATA nosuch w2 3 []",
    b"USER_SYNC w2 @u:h DEV start 1700000000000", b"CLEAR_USER_SYNC w2", b"FEDERATION_ACK w2 3",
    b"REMOTE_SERVER_UP other.test", b"AUTH s3cret", b"", b"   ",
])
_core_lines = st.one_of(_lines, _lines, _lines, _VALID_LINES)
#: What a peer sends first, by the side of the core it talks to.
_HANDSHAKE = {Side.SERVER: [b"NAME w2", b"PING 1"], Side.CLIENT: [b"SERVER fuzz", b"PING 1"], Side.BOTH: []}
COUNTS = {"parse": 0, "core": 0, "core_established": 0, "cores": 0}


def _open_core(side: Side, *, handshake: bool, now: float) -> ConnectionCore:
    """A new connected core for ``side``, optionally already past the peer's handshake lines."""
    core = ConnectionCore(side, server_name="fuzz", instance_name="w1")
    core.connection_made(now)
    COUNTS["cores"] += 1
    if handshake:
        for line in _HANDSHAKE[side]:
            core.line_received(line, now)
    return core


class ParserFuzzTest(SynchronousTestCase):
    def test_parse_line(self):
        """Random lines parse or raise ProtocolError; nothing else escapes; at least 100 000 lines are tried."""
        before = COUNTS["parse"]
        self.fuzz_parse_line()
        self.assert_fuzzed("parser", COUNTS["parse"] - before)

    def test_connection_core(self):
        """Random lines into connection cores never raise; a close is preceded by exactly one ERROR and
        silences the core; whatever is delivered is a command the peer may send; at least 100 000 lines
        reach an open core.

        A closed core is replaced by a new one (every other one already past the handshake), so every
        line counted reached an open core.
        """
        before, established, cores = COUNTS["core"], COUNTS["core_established"], COUNTS["cores"]
        self.fuzz_connection_core()
        print(f"fuzzed: {COUNTS['core_established'] - established} lines past the handshake, "
              f"{COUNTS['cores'] - cores} cores")
        self.assert_fuzzed("connection-core", COUNTS["core"] - before)

    def assert_fuzzed(self, what: str, count: int) -> None:
        print(f"fuzzed: {count} {what} inputs")
        self.assertGreaterEqual(count, 100_000)

    @FUZZ
    @given(st.lists(_lines, min_size=LINES_PER_EXAMPLE, max_size=LINES_PER_EXAMPLE))
    def fuzz_parse_line(self, lines):
        for line in lines:
            COUNTS["parse"] += 1
            try:
                parse_line(line)
            except ProtocolError:
                pass

    @FUZZ
    @given(st.sampled_from([Side.SERVER, Side.CLIENT, Side.BOTH]),
           st.lists(_core_lines, min_size=LINES_PER_EXAMPLE, max_size=LINES_PER_EXAMPLE))
    def fuzz_connection_core(self, side, lines):
        core = None
        for i, line in enumerate(lines):
            line = line.replace(b"\n", b" ")
            if core is None or core.state is State.CLOSED:
                core = _open_core(side, handshake=COUNTS["cores"] % 2 == 1, now=float(i))
            COUNTS["core"] += 1
            COUNTS["core_established"] += core.handshake_complete
            actions = core.line_received(line, float(i))
            for action in actions:
                if isinstance(action, Deliver):
                    self.assertTrue(may_send(type(action.command), side.peer), action)
            if any(isinstance(a, Close) for a in actions):
                errors = [a for a in actions if isinstance(a, SendLine) and a.data.startswith(b"ERROR ")]
                self.assertEqual(len(errors), 1, actions)
                self.assertIs(core.state, State.CLOSED)
                # A closed core ignores whatever still arrives (not counted: it reaches no open core).
                self.assertEqual(core.line_received(b"PING 1", float(i)), [])


class TokenFuzzTest(SynchronousTestCase):
    @settings(max_examples=5000, deadline=None, derandomize=True)
    @given(st.one_of(st.text(max_size=60), st.from_regex(r"[sm][0-9~.\-a]{0,40}", fullmatch=True)))
    def test_tokens(self, text):
        """Any text parses to a token that round-trips, or raises TokenError."""
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
        # other.test's key is pinned, so signed fuzz reaches /send's own validation past the signature gate.
        self.peer_key = generate_signing_key("k")
        pinned = public_key_base64(self.peer_key)
        self.master, self.url = yield single_master(
            self, "federation: {destinations: {other.test: 'http://127.0.0.1:1'}, "
                  f"trusted_keys: {{other.test: {{'ed25519:k': '{pinned}'}}}}}}\n", server_name="fuzz.test"
        )
        self.pool = new_pool()
        self.addCleanup(self.pool.closeCachedConnections)

    def test_random_requests(self):
        """Random bodies, paths and parameters never get a 500 and never stop the server; every refusal
        (client API and inbound federation) is a JSON body with ``errcode`` and ``error``."""
        return ensureDeferred(self._fuzz())

    async def _fuzz(self):
        rng = random.Random(11)
        user = await Client(self.url, self.pool).register("fuzzer")
        room = await user.create_room()
        anon = Client(self.url, self.pool)
        statuses: dict[int, int] = {}
        fed_errors: dict[str, int] = {}
        gme_errors: dict[str, int] = {}
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
                method, path = "PUT", f"/_matrix/federation/v1/send/fz{i}"
                headers = {}
                if i % 2:
                    # get_missing_events, as an allowed origin (its own room check then refuses or answers).
                    method, path = "POST", f"/_matrix/federation/v1/get_missing_events/{quote(room, safe='')}"
                try:
                    content_json = json.loads(body)
                except (ValueError, RecursionError):
                    pass
                else:
                    if rng.random() < 0.7:
                        try:
                            headers["Authorization"] = [auth_header("other.test", "fuzz.test", self.peer_key, method,
                                                                    path, content_json)]
                        except (ValueError, UnicodeError):
                            pass  # content no signer can encode: sent unsigned
                try:
                    response = await fed.http.request(method, self.url + path, data=body, headers=headers,
                                                      timeout=30)
                    content = await response.content()
                    code = response.code
                except Exception as e:
                    self.fail(f"federation request {i} failed at the transport: {e!r}")
                content_type = response.headers.getRawHeaders(b"Content-Type", [b""])[0]
                self.assertTrue(content_type.startswith(b"application/json"), f"{path}: {content_type!r}")
                try:
                    reply = json.loads(content)
                except ValueError:
                    self.fail(f"federation request {i} got a non-JSON {code} reply: {content[:200]!r}")
                self.assertIsInstance(reply, dict, f"{path}: {content[:200]!r}")
                if code != 200:
                    self.assertIsInstance(reply.get("errcode"), str, f"{path}: {code} without errcode: {reply}")
                    self.assertIsInstance(reply.get("error"), str, f"{path}: {code} without error: {reply}")
                    fed_errors[reply["errcode"]] = fed_errors.get(reply["errcode"], 0) + 1
                    if method == "POST":
                        gme_errors[reply["errcode"]] = gme_errors.get(reply["errcode"], 0) + 1
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
        print(f"fuzzed {self.REQUESTS} HTTP requests: statuses {sorted(statuses.items())}; "
              f"federation errors {sorted(fed_errors.items())}")
        self.assertTrue(fed_errors, "no federation request was refused: the fuzz did not reach /send")
        self.assertTrue(set(fed_errors) - {"M_UNAUTHORIZED", "M_NOT_JSON"},
                        "no signed request reached an endpoint's own validation")
        self.assertTrue(gme_errors, "no get_missing_events request was refused: the fuzz did not reach it")
        await user.send(room, {"body": "still alive"}, "final")
