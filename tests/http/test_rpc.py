"""Internal RPC: the real RpcServer behind a real listener, and RpcClient retries and waits on a fake clock."""

from __future__ import annotations

import json
import random
from io import BytesIO
from typing import Any

from treq.testing import StubTreq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred, fail, inlineCallbacks
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool, ResponseFailed, readBody
from twisted.web.http_headers import Headers

from synflow.backoff import Backoff
from synflow.config import HostPort
from synflow.errors import HttpApiError
from synflow.http.rpc import PREFIX, RESPONSE_CACHE_S, PositionSource, RpcClient, RpcServer
from synflow.http.site import HealthResource, build_site
from synflow.replication.commands import PositionCommand
from synflow.replication.handler import ReplicationHandler
from tests.replication.fakes import DiscardingConn, positions_view

SECRET = "s"


def make_positions(
    name: str, clock: Any, *, own: int | None = None, known: dict[str, int] | None = None, wait_s: float = 5.0
) -> tuple[PositionSource, ReplicationHandler, DiscardingConn]:
    """A real replication handler (writing ``events`` at ``own`` if given) and its PositionSource."""
    handler, conn = positions_view(name, clock, own=own, known=known)
    return PositionSource(handler, wait_s), handler, conn


class _Counting:
    """An RPC method that records its calls and answers at once, or once ``gate`` fires."""

    def __init__(self, result: Any = "done") -> None:
        self.calls: list[Any] = []
        self.result = result
        self.gate: Deferred[None] | None = None

    async def __call__(self, args: Any) -> Any:
        self.calls.append(args)
        if self.gate is not None:
            await self.gate
        return {"echo": args, "result": self.result, "n": len(self.calls)}


class ServedOverTcpTest(TestCase):
    """The RpcServer in a real listener site, on a loopback port, through real HTTP."""

    timeout = 20

    def setUp(self) -> None:
        self.positions, self.handler, _ = make_positions("srv", reactor, own=3)
        self.server = RpcServer(self.positions, reactor, SECRET)
        self.method = _Counting()
        self.server.register("echo", self.method)
        site = build_site({PREFIX: self.server}, health=HealthResource(lambda: []), max_body_bytes=1024 * 1024)
        self.port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.agent = Agent(reactor, pool=self.pool)

    def url(self, name: str, txn_id: str) -> bytes:
        return f"http://127.0.0.1:{self.port.getHost().port}{PREFIX}/{name}/{txn_id}".encode()

    async def post(self, name: str, txn_id: str, body: dict[str, Any], auth: bytes | None) -> tuple[int, Any]:
        headers = Headers({b"Content-Type": [b"application/json"]})
        if auth is not None:
            headers.addRawHeader(b"Authorization", auth)
        response = await self.agent.request(b"POST", self.url(name, txn_id), headers,
                                            FileBodyProducer(BytesIO(json.dumps(body).encode())))
        return response.code, json.loads(await readBody(response))

    def client(self, secret: str | None) -> RpcClient:
        positions, _, _ = make_positions("caller", reactor, known={"srv": 3})
        client = RpcClient(reactor, {"srv": HostPort("127.0.0.1", self.port.getHost().port)}, positions, secret)
        self.addCleanup(client.close)
        return client

    @inlineCallbacks
    def test_secret_required(self):
        """Without the bearer secret, or with a wrong one, the call is refused with 401 and never runs."""
        for auth in (None, b"Bearer wrong", b"Bearer s2", b"Bearer ", b"Basic s"):
            code, body = yield ensureDeferred(self.post("echo", "t1", {"args": {}}, auth))
            self.assertEqual((code, body["errcode"]), (401, "M_UNAUTHORIZED"), auth)
        self.assertEqual(self.method.calls, [])
        code, body = yield ensureDeferred(self.post("echo", "t1", {"args": {"x": 1}}, b"Bearer s"))
        self.assertEqual(code, 200)
        self.assertEqual(body["result"]["echo"], {"x": 1})
        self.assertEqual(body["positions"], {"events": {"srv": 3}})
        self.assertEqual(self.method.calls, [{"x": 1}])

    @inlineCallbacks
    def test_unknown_method_names_are_not_metric_labels(self):
        """A refused call to a made-up method is counted under ``other``, never under its name."""
        from prometheus_client import REGISTRY

        def count(name: str) -> float:
            return REGISTRY.get_sample_value("synflow_rpc_served_total",
                                             {"name": name, "outcome": "unauthorized"}) or 0.0

        before = count("other")
        made_up = "x" + "".join(random.choice("abcdefghij") for _ in range(20))
        code, _ = yield ensureDeferred(self.post(made_up, "t1", {"args": {}}, None))
        self.assertEqual(code, 401)
        self.assertEqual(count("other") - before, 1)
        self.assertIsNone(REGISTRY.get_sample_value("synflow_rpc_served_total",
                                                    {"name": made_up, "outcome": "unauthorized"}))

    @inlineCallbacks
    def test_client_secret(self):
        """RpcClient with the right secret gets the result; with none or a wrong one, a 401 HttpApiError."""
        for secret in (None, "wrong"):
            with self.assertRaises(HttpApiError) as cm:
                yield ensureDeferred(self.client(secret).call("srv", "echo", {"a": 1}))
            self.assertEqual((cm.exception.code, cm.exception.errcode), (401, "M_UNAUTHORIZED"))
        self.assertEqual(self.method.calls, [])
        result = yield ensureDeferred(self.client(SECRET).call("srv", "echo", {"a": 1}))
        self.assertEqual(result["echo"], {"a": 1})
        self.assertEqual(self.method.calls, [{"a": 1}])

    @inlineCallbacks
    def test_same_txn_id_runs_once(self):
        """The same txn_id posted twice runs the method once and answers both with the same response."""
        first = yield ensureDeferred(self.post("echo", "txnA", {"args": {"v": 1}}, b"Bearer s"))
        second = yield ensureDeferred(self.post("echo", "txnA", {"args": {"v": 1}}, b"Bearer s"))
        self.assertEqual(first, second)
        self.assertEqual(len(self.method.calls), 1)
        other = yield ensureDeferred(self.post("echo", "txnB", {"args": {"v": 1}}, b"Bearer s"))
        self.assertEqual(len(self.method.calls), 2)
        self.assertEqual(other[1]["result"]["n"], 2)

    @inlineCallbacks
    def test_retry_while_first_attempt_runs(self):
        """A retry that arrives while the first attempt still runs waits for it instead of running again."""
        self.method.gate = Deferred()
        first = ensureDeferred(self.post("echo", "slow", {"args": {}}, b"Bearer s"))
        second = ensureDeferred(self.post("echo", "slow", {"args": {}}, b"Bearer s"))
        while len(self.method.calls) < 1:
            yield _later(0.01)
        yield _later(0.1)
        self.assertFalse(first.called or second.called)
        self.method.gate.callback(None)
        a = yield first
        b = yield second
        self.assertEqual(a, b)
        self.assertEqual(len(self.method.calls), 1)


def _later(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


class _Http:
    """A treq-like client over StubTreq (the real server resource) that can fail chosen attempts.

    ``plan`` lists, per attempt, ``None`` (deliver), ``"connect"`` (refused before
    reaching the server) or ``"lost"`` (delivered, but the answer is lost).
    """

    def __init__(self, resource: Any, plan: list[str | None]) -> None:
        self.stub = StubTreq(resource)
        self.plan = list(plan)
        self.posts: list[tuple[str, bytes, dict[Any, Any]]] = []

    def post(self, url: str, data: bytes, headers: dict[Any, Any], timeout: float) -> Deferred[Any]:
        self.posts.append((url, data, headers))
        step = self.plan.pop(0) if self.plan else None
        if step == "connect":
            return fail(ConnectionRefusedError("refused"))
        d = self.stub.post(url, data=data, headers=headers)
        self.stub.flush()
        if step == "lost":
            return d.addCallback(lambda _: fail(ResponseFailed([])))
        return d


class ClientTest(SynchronousTestCase):
    """RpcClient against the real RpcServer resource, with an injected HTTP layer and clock."""

    def setUp(self) -> None:
        self.server_clock = Clock()
        self.server_positions, self.server_handler, self.server_conn = make_positions(
            "srv", self.server_clock, own=20, known={"caller": 1})
        self.server = RpcServer(self.server_positions, self.server_clock, SECRET)
        self.method = _Counting()
        self.server.register("echo", self.method)
        self.reactor = MemoryReactorClock()

    def client(self, plan: list[str | None], *, own: int = 1, known_srv: int = 20,
               wait_s: float = 5.0) -> tuple[RpcClient, _Http, ReplicationHandler, DiscardingConn]:
        positions, handler, conn = make_positions("caller", self.reactor, own=own, known={"srv": known_srv},
                                                  wait_s=wait_s)
        http = _Http(self.server, plan)
        client = RpcClient(self.reactor, {"srv": HostPort("127.0.0.1", 1)}, positions, SECRET,
                           backoff=Backoff(initial_s=1.0, multiplier=2.0, max_s=8.0, jitter=0.0),
                           rng=random.Random(0), http=http)
        return client, http, handler, conn

    def flush(self, http: _Http) -> None:
        http.stub.flush()

    def test_connect_error_retried_with_backoff(self):
        """Connect errors are retried after 1 s then 2 s on the injected clock, with the same URL, body and txn id."""
        client, http, _, _ = self.client(["connect", "connect"])
        d = ensureDeferred(client.call("srv", "echo", {"k": "v"}))
        self.assertEqual(len(http.posts), 1)
        self.reactor.advance(0.999)
        self.assertEqual(len(http.posts), 1)
        self.reactor.advance(0.001)
        self.assertEqual(len(http.posts), 2)
        self.reactor.advance(1.999)
        self.assertEqual(len(http.posts), 2)
        self.assertNoResult(d)
        self.reactor.advance(0.001)
        self.flush(http)
        self.assertEqual(len(http.posts), 3)
        result = self.successResultOf(d)
        self.assertEqual(result["echo"], {"k": "v"})
        self.assertEqual(len({url for url, _, _ in http.posts}), 1)
        self.assertEqual(len({body for _, body, _ in http.posts}), 1)
        self.assertRegex(http.posts[0][0], rf"^http://127\.0\.0\.1:1{PREFIX}/echo/[A-Za-z0-9_-]+$")
        self.assertEqual(self.method.calls, [{"k": "v"}])

    def test_lost_answer_retried_idempotently(self):
        """An attempt that ran on the server but whose answer was lost is retried, and the method runs once."""
        client, http, _, _ = self.client(["lost"])
        d = ensureDeferred(client.call("srv", "echo", {"k": 1}))
        self.flush(http)
        self.assertEqual(len(self.method.calls), 1)
        self.assertNoResult(d)
        self.reactor.advance(1.0)
        self.flush(http)
        self.assertEqual(self.successResultOf(d)["n"], 1)
        self.assertEqual(len(self.method.calls), 1)
        self.assertEqual(http.posts[0][0], http.posts[1][0])

    def test_stopping_server_refuses_new_calls_and_the_client_retries(self):
        """A stopping process answers new calls 503 M_STOPPING without running them; the client retries with backoff until one runs."""
        client, http, _, _ = self.client([])
        self.server.stopping = True
        d = ensureDeferred(client.call("srv", "echo", {"k": 1}))
        self.flush(http)
        self.assertEqual(len(http.posts), 1)
        self.assertEqual(self.method.calls, [])
        self.assertNoResult(d)
        self.reactor.advance(1.0)
        self.flush(http)
        self.assertEqual(len(http.posts), 2)  # refused again: still stopping
        self.assertEqual(self.method.calls, [])
        self.server.stopping = False  # the process came back (a restart, here the same resource)
        self.reactor.advance(2.0)
        self.flush(http)
        self.assertEqual(self.successResultOf(d)["echo"], {"k": 1})
        self.assertEqual(self.method.calls, [{"k": 1}])

    def test_unreachable_gives_up(self):
        """After the last attempt fails to connect, the call fails with 502 naming the instance."""
        client, http, _, _ = self.client(["connect"] * 10)
        d = ensureDeferred(client.call("srv", "echo", {}))
        self.reactor.pump([1.0] * 60)
        failure = self.failureResultOf(d, HttpApiError)
        self.assertEqual(failure.value.code, 502)
        self.assertIn("srv", failure.value.msg)
        self.assertEqual(len(http.posts), 6)
        self.assertEqual(self.method.calls, [])

    def test_remote_error_is_the_same_error(self):
        """A remote 403 {errcode, error} is raised to the caller as HttpApiError(403) with the same errcode and text."""

        async def refuse(args: Any) -> Any:
            raise HttpApiError(403, "M_FORBIDDEN", "@u:hs is not joined to room !r:hs", detail="x")

        self.server.register("refuse", refuse)
        client, http, _, _ = self.client([])
        d = ensureDeferred(client.call("srv", "refuse", {}))
        self.flush(http)
        error = self.failureResultOf(d, HttpApiError).value
        self.assertEqual((error.code, error.errcode, error.msg), (403, "M_FORBIDDEN", "@u:hs is not joined to room !r:hs"))
        self.assertEqual(error.extra, {"detail": "x"})

    def test_server_waits_for_callers_positions(self):
        """The server runs the method only once it has seen the caller's positions."""
        client, http, _, _ = self.client([], own=9)
        d = ensureDeferred(client.call("srv", "echo", {}))
        self.flush(http)
        self.assertEqual(self.method.calls, [])
        self.server_clock.advance(4.9)
        self.assertEqual(self.method.calls, [])
        self.server_handler.on_command(self.server_conn, PositionCommand("events", "caller", 1, 9))
        self.flush(http)
        self.assertEqual(len(self.method.calls), 1)
        self.successResultOf(d)

    def test_server_wait_is_bounded(self):
        """If the caller's positions never arrive, the server runs the method after its wait timeout."""
        client, http, _, _ = self.client([], own=9)
        d = ensureDeferred(client.call("srv", "echo", {}))
        self.flush(http)
        self.server_clock.advance(4.999)
        self.assertEqual(self.method.calls, [])
        self.server_clock.advance(0.001)
        self.flush(http)
        self.assertEqual(len(self.method.calls), 1)
        self.successResultOf(d)

    def test_caller_waits_for_servers_positions(self):
        """The caller returns only once it has seen the positions the server answered with."""
        client, http, handler, conn = self.client([], known_srv=15)
        d = ensureDeferred(client.call("srv", "echo", {}))
        self.flush(http)
        self.assertEqual(len(self.method.calls), 1)
        self.reactor.advance(4.9)
        self.assertNoResult(d)
        handler.on_command(conn, PositionCommand("events", "srv", 15, 20))
        self.assertEqual(self.successResultOf(d)["n"], 1)

    def test_caller_wait_is_bounded(self):
        """If the server's positions never arrive, the caller returns after its wait timeout."""
        client, http, _, _ = self.client([], known_srv=15, wait_s=2.0)
        d = ensureDeferred(client.call("srv", "echo", {}))
        self.flush(http)
        self.reactor.advance(1.999)
        self.assertNoResult(d)
        self.reactor.advance(0.001)
        self.successResultOf(d)

    def test_cached_response_expires(self):
        """A txn_id's response is replayed for RESPONSE_CACHE_S; after that the same txn_id runs again."""
        stub = StubTreq(self.server)

        def post() -> Any:
            d = stub.post(f"http://srv{PREFIX}/echo/t1", data=b'{"args": {}}', headers={b"Authorization": [b"Bearer s"]})
            stub.flush()
            return self.successResultOf(self.successResultOf(d).json())

        self.assertEqual(post()["result"]["n"], 1)
        self.server_clock.advance(RESPONSE_CACHE_S - 1)
        self.assertEqual(post()["result"]["n"], 1)
        self.server_clock.advance(1)
        self.assertEqual(post()["result"]["n"], 2)

    def test_bad_positions_refused(self):
        """Positions that are not integers get 400 M_BAD_JSON and the method does not run."""
        stub = StubTreq(self.server)
        d = stub.post(f"http://srv{PREFIX}/echo/t1", data=json.dumps({"args": {}, "positions": {"events": {"w": "9"}}}),
                      headers={b"Authorization": [b"Bearer s"]})
        stub.flush()
        response = self.successResultOf(d)
        self.assertEqual(response.code, 400)
        body = self.successResultOf(response.json())
        self.assertEqual(body["errcode"], "M_BAD_JSON")
        self.assertEqual(self.method.calls, [])
