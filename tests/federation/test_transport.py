"""The treq transport on StubTreq: the request it makes and how it classifies replies."""

from __future__ import annotations

import json
from typing import Any

from OpenSSL import SSL
from treq.testing import StubTreq
from twisted.internet import reactor, ssl
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, fail
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import MemoryReactorClock
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.test import iosim
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from synflow.config import FederationConfig
from synflow.federation.interfaces import TransactionFailed
from synflow.federation.transport import NoVerifyPolicy, TreqFederationTransport, build_treq_client

BODY = {"origin": "local.test", "origin_server_ts": 1, "pdus": [{"event_id": "$e"}]}


class Remote(Resource):
    """Records each request and answers with a configured status and body."""

    isLeaf = True

    def __init__(self, code: int = 200, reply: bytes = b'{"pdus": {}}', hang: bool = False) -> None:
        super().__init__()
        self.code, self.reply, self.hang = code, reply, hang
        self.requests: list[dict[str, Any]] = []

    def render(self, request: Any) -> Any:
        self.requests.append({
            "method": request.method,
            "uri": request.uri,
            "host": request.getHeader(b"host"),
            "content_type": request.getHeader(b"content-type"),
            "body": request.content.read(),
        })
        if self.hang:
            return NOT_DONE_YET
        request.setResponseCode(self.code)
        return self.reply


def transport(remote: Resource, clock: Clock | None = None, **kwargs: Any) -> TreqFederationTransport:
    return TreqFederationTransport(
        StubTreq(remote), {"remote.test": "http://127.0.0.1:8448/"}, clock or Clock(), 30.0, **kwargs
    )


class RequestTest(SynchronousTestCase):
    def test_put_json_to_the_send_endpoint(self):
        """The transaction is PUT as compact JSON to {base_url}/_matrix/federation/v1/send/{txnId}."""
        remote = Remote()
        t = transport(remote)
        self.assertEqual(self.successResultOf(t.send_transaction("remote.test", "17.1", BODY)), {"pdus": {}})
        (req,) = remote.requests
        self.assertEqual(req["method"], b"PUT")
        self.assertEqual(req["uri"], b"/_matrix/federation/v1/send/17.1")
        self.assertTrue(req["content_type"].startswith(b"application/json"))
        self.assertEqual(json.loads(req["body"]), BODY)

    def test_auth_headers_are_added(self):
        """auth_headers(destination, method, path, body) adds headers, e.g. an X-Matrix signature."""
        remote = Remote()
        calls = []

        def sign(destination, method, path, body):
            calls.append((destination, method, path, body))
            return {b"Authorization": [b"X-Matrix origin=local.test"]}

        seen = []
        remote.render = lambda request: seen.append(request.getHeader(b"authorization")) or b"{}"
        t = transport(remote, auth_headers=sign)
        self.successResultOf(t.send_transaction("remote.test", "a b", BODY))
        self.assertEqual(calls, [("remote.test", "PUT", "/_matrix/federation/v1/send/a%20b", BODY)])
        self.assertEqual(seen, [b"X-Matrix origin=local.test"])

    def test_base_url_defaults_to_https_server_name(self):
        """An unconfigured destination is reached at https://<server_name>, and IDs are URL-quoted."""
        remote = Remote()
        t = transport(remote)
        self.assertEqual(t.base_url("remote.test"), "http://127.0.0.1:8448")
        self.assertEqual(t.send_url("other.test:8448", "a/b c"),
                         "https://other.test:8448/_matrix/federation/v1/send/a%2Fb%20c")
        self.successResultOf(t.send_transaction("other.test", "1", BODY))
        self.assertEqual(remote.requests[0]["host"], b"other.test")


class ClassificationTest(SynchronousTestCase):
    def failure(self, t: TreqFederationTransport) -> TransactionFailed:
        f = self.failureResultOf(t.send_transaction("remote.test", "1", BODY), TransactionFailed)
        assert isinstance(f.value, TransactionFailed)
        return f.value

    def test_status_codes(self):
        """5xx, 408 and 429 are retriable failures; other 4xx are not; 2xx JSON objects succeed."""
        for code, retriable in [(500, True), (502, True), (503, True), (408, True), (429, True),
                                (400, False), (401, False), (403, False), (404, False)]:
            e = self.failure(transport(Remote(code, b'{"errcode": "X"}')))
            self.assertEqual(e.retriable, retriable, code)
            self.assertIn(str(code), e.reason)
        self.successResultOf(transport(Remote(201)).send_transaction("remote.test", "1", BODY))

    def test_malformed_replies(self):
        """A 200 whose body is not a JSON object, or is too large, is a retriable failure."""
        for reply in (b"not json", b"[1]", b"\xff", b""):
            self.assertTrue(self.failure(transport(Remote(200, reply))).retriable, reply)
        e = self.failure(transport(Remote(200, b'{"a": "' + b"x" * 2000 + b'"}'), max_response_bytes=1000))
        self.assertIn("larger", e.reason)

    def test_timeout_on_the_injected_clock(self):
        """No reply within the timeout fails the transaction, on the injected clock."""
        clock = Clock()
        d = transport(Remote(hang=True), clock).send_transaction("remote.test", "1", BODY)
        clock.advance(29)
        self.assertNoResult(d)
        clock.advance(1)
        e = self.failureResultOf(d, TransactionFailed).value
        self.assertTrue(e.retriable)
        self.assertIn("no reply", e.reason)

    def test_connection_errors(self):
        """A refused connection is a retriable failure."""
        class Refusing:
            def request(self, method: str, url: str, **kwargs: Any) -> Any:
                return fail(ConnectionRefusedError())

        t = TreqFederationTransport(Refusing(), {}, Clock(), 5)
        e = self.failureResultOf(t.send_transaction("remote.test", "1", BODY), TransactionFailed).value
        self.assertTrue(e.retriable)
        self.assertIn("ConnectionRefusedError", e.reason)


class TlsTest(SynchronousTestCase):
    def test_no_verify_policy_turns_verification_off(self):
        """verify_tls=False connections send SNI but do not verify the certificate."""
        creator = NoVerifyPolicy().creatorForNetloc(b"remote.test", 443)
        conn = creator.clientConnectionForTLS(object())
        self.assertEqual(conn.get_context().get_verify_mode(), SSL.VERIFY_NONE)
        self.assertEqual(conn.get_servername(), b"remote.test")
        ip_conn = NoVerifyPolicy().creatorForNetloc(b"127.0.0.1", 443).clientConnectionForTLS(object())
        self.assertIsNone(ip_conn.get_servername())



class SelfSignedRemote(Resource):
    """A remote's /send behind a self-signed certificate for remote.test (no subjectAltName, no trusted root)."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        key = ssl.KeyPair.generate(size=2048)
        cert = key.selfSignedCert(1, CN="remote.test")
        self.tls = ssl.CertificateOptions(privateKey=key.original, certificate=cert.original)
        self.bodies: list[bytes] = []

    def render_PUT(self, request: Any) -> bytes:
        self.bodies.append(request.content.read())
        return b'{"pdus": {}}'

    async def answer(self, testcase: TestCase, clock: MemoryReactorClock, d: Deferred[Any]) -> Any:
        """Connect the client's pending TCP attempt to this server over in-memory TLS; return ``d``'s outcome.

        The TLS layer batches its writes on the global reactor, so the pump
        yields to it between steps; no socket is opened.
        """
        results: list[Any] = []
        d.addBoth(results.append)
        (host, port, factory, _timeout, _bind), = clock.tcpClients
        testcase.assertEqual((host, port), ("127.0.0.1", 8448))
        client = factory.buildProtocol(IPv4Address("TCP", host, port))
        server = TLSMemoryBIOFactory(self.tls, False, Site(self, reactor=clock)).buildProtocol(
            IPv4Address("TCP", "127.0.0.1", 40000))
        pump = iosim.connect(server, iosim.FakeTransport(server, isServer=True),
                             client, iosim.FakeTransport(client, isServer=False))
        for _ in range(100):
            if results:
                return results[0]
            pump.pump()
            clock.advance(0)
            await deferLater(reactor, 0, lambda: None)
        testcase.fail("no outcome after 100 pumps")


class TlsVerificationTest(TestCase):
    """TLS verification is on unless configured off, end to end through the real agent and a TLS server."""

    def config(self, **kwargs: Any) -> FederationConfig:
        return FederationConfig(destinations={"remote.test": "https://127.0.0.1:8448"}, **kwargs)

    async def test_build_treq_client_verifies_by_default(self) -> None:
        """The default client refuses a certificate no trusted root signed; verify_tls=False accepts it."""
        remote = SelfSignedRemote()
        clock = MemoryReactorClock()
        outcome = await remote.answer(self, clock, build_treq_client(clock, persistent=False).put(
            "https://remote.test:8448/_matrix/federation/v1/send/1", data=b"{}"))
        self.assertIsInstance(outcome, Failure)
        self.assertIn("certificate verify failed", str(outcome.value))
        self.assertEqual(remote.bodies, [])
        self.flushLoggedErrors()  # the verifier logs why it refused

        clock = MemoryReactorClock()
        outcome = await remote.answer(self, clock, build_treq_client(clock, verify_tls=False, persistent=False).put(
            "https://remote.test:8448/_matrix/federation/v1/send/1", data=b"{}"))
        self.assertEqual(outcome.code, 200)
        self.assertEqual(remote.bodies, [b"{}"])

    async def test_from_config_verifies_unless_configured_off(self) -> None:
        """A transport from the federation config verifies certificates by default and not with verify_tls: false."""
        remote = SelfSignedRemote()
        clock = MemoryReactorClock()
        t = TreqFederationTransport.from_config(clock, self.config())
        outcome = await remote.answer(self, clock, t.send_transaction("remote.test", "1", BODY))
        self.assertIsInstance(outcome, Failure)
        outcome.trap(TransactionFailed)
        self.assertIn("certificate verify failed", outcome.value.reason)
        self.assertEqual(remote.bodies, [])
        self.flushLoggedErrors()

        clock = MemoryReactorClock()
        t = TreqFederationTransport.from_config(clock, self.config(verify_tls=False))
        outcome = await remote.answer(self, clock, t.send_transaction("remote.test", "1", BODY))
        self.assertEqual(outcome, {"pdus": {}})
        self.assertEqual([json.loads(b) for b in remote.bodies], [BODY])

    def test_request_timeout_comes_from_config(self) -> None:
        """federation.request_timeout_s bounds a /send exchange on the transport's reactor."""
        clock = MemoryReactorClock()
        t = TreqFederationTransport.from_config(clock, self.config(request_timeout_s=7.0))
        d = t.send_transaction("remote.test", "1", BODY)  # the TCP attempt never completes
        clock.advance(6.9)
        self.assertNoResult(d)
        clock.advance(0.1)
        failure = self.failureResultOf(d, TransactionFailed)
        self.assertEqual(failure.value.reason, "no reply within 7.0s")
        self.assertTrue(failure.value.retriable)
