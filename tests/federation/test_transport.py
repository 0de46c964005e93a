"""The treq transport on StubTreq: the request it makes and how it classifies replies."""

from __future__ import annotations

import json
from typing import Any

from OpenSSL import SSL
from treq.testing import StubTreq
from twisted.internet.defer import fail
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

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
            def put(self, url: str, **kwargs: Any) -> Any:
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

    def test_build_treq_client(self):
        """build_treq_client returns a treq client for either setting."""
        for verify in (True, False):
            client = build_treq_client(MemoryReactorClock(), verify_tls=verify, persistent=False)
            self.assertTrue(callable(client.put))
