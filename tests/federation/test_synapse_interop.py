"""Interop with Synapse's own federation signing and verification code.

``matrix-synapse`` is a test-only dependency (the ``test`` extra). No
Synapse homeserver is built: each test calls the exact Synapse functions a
homeserver uses, on stand-ins for the homeserver objects they read
(``server_name``, ``signing_key``, a clock, a store that remembers nothing):

* signing: ``MatrixFederationHttpClient.build_auth_headers`` (the
  ``Authorization`` headers Synapse puts on every outbound federation
  request) and ``LocalKey.response_json_object`` (Synapse's
  ``/_matrix/key/v2/server`` body);
* verifying: ``Authenticator.authenticate_request`` (Synapse's inbound
  check, with its ``_parse_auth_header``), whose key look-up goes through
  ``Keyring.process_request``/``process_json``, fed by
  ``BaseV2KeyFetcher.process_v2_response`` (Synapse's check of a remote's key
  response) over the body synflow's key endpoint serves.

Importing Synapse's federation modules imports ``synapse.app``, which runs
Synapse's dependency check and exits when an installed optional dependency
is outside Synapse's pins: synflow needs txredisapi 1.6 while Synapse's
``redis`` extra (not used here) pins it below 1.6. The check is replaced by
a no-op before the import; nothing else of Synapse is changed.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from signedjson.key import generate_signing_key
from treq.testing import StubTreq
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers

from synflow.federation.auth import (
    FEDERATION_PREFIX,
    KEY_PATH,
    FederationAuthResource,
    ServerKeyResource,
    require_origin,
)
from synflow.federation.keyring import KeyRing
from synflow.federation.signing import auth_header
from synflow.http.site import PrefixRoot
from tests.federation.test_inbound import Receiver


def _import_synapse() -> Any:
    from synapse.util import check_dependencies

    check_dependencies.check_requirements = lambda extra=None: None
    import synapse.api.errors as errors
    import synapse.crypto.keyring as keyring
    import synapse.federation.transport.server._base as server_base
    import synapse.http.matrixfederationclient as client
    import synapse.rest.key.v2.local_key_resource as local_key

    return client, server_base, keyring, local_key, errors


SYNAPSE_CLIENT, SYNAPSE_SERVER, SYNAPSE_KEYRING, SYNAPSE_LOCAL_KEY, SYNAPSE_ERRORS = _import_synapse()

SYNAPSE = "synapse.test"
SYNFLOW = "synflow.test"
SEND = "/_matrix/federation/v1/send"
NOW_S = 1_700_000_000


class NullStore:
    """What Synapse's key fetcher and authenticator ask of their database: nothing remembered."""

    async def store_server_keys_response(self, **kwargs: Any) -> None:
        return None

    async def get_destination_retry_timings(self, destination: str) -> None:
        return None


class SynapseServer:
    """The attributes of a Synapse homeserver its signing and verifying functions read."""

    def __init__(self, signing_key: Any, synflow_key_response: Any = None) -> None:
        self.server_name = SYNAPSE
        self.signing_key = signing_key
        # LocalKey.response_json_object reads these.
        self.config = _Namespace(key=_Namespace(signing_key=[signing_key], old_signing_keys={}),
                                 server=_Namespace(server_name=SYNAPSE))
        self.valid_until_ts = NOW_S * 1000 + 86_400_000
        # Authenticator.authenticate_request reads these.
        self._clock = _Namespace(time_msec=lambda: NOW_S * 1000)
        self._is_mine_server_name = lambda name: name == SYNAPSE
        self.federation_domain_whitelist = None
        self.store = NullStore()
        self.keyring = _SynapseKeyring(synflow_key_response)


class _Namespace:
    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


class _FetchQueue:
    """Stands for Synapse's batching key-fetch queue: runs Synapse's own key-response check."""

    def __init__(self, response: Any) -> None:
        self.response = response

    async def add_to_queue(self, request: Any, key: str) -> dict[str, Any]:
        fetcher = _Namespace(store=NullStore())
        keys = await SYNAPSE_KEYRING.BaseV2KeyFetcher.process_v2_response(fetcher, key, self.response, NOW_S * 1000)
        return {key: keys}


class _SynapseKeyring:
    """Synapse's ``Keyring.verify_json_for_server`` path, its key fetch fed synflow's served key response."""

    def __init__(self, response: Any) -> None:
        self._is_mine_server_name = lambda name: name == SYNAPSE
        self._local_verify_keys: dict[str, Any] = {}
        self._fetch_keys_queue = _FetchQueue(response)
        self.process_json = functools.partial(SYNAPSE_KEYRING.Keyring.process_json, self)

    async def verify_json_for_server(self, server_name: str, json_object: Any, validity_time: int) -> None:
        request = SYNAPSE_KEYRING.VerifyJsonRequest.from_json_object(server_name, json_object, validity_time)
        await SYNAPSE_KEYRING.Keyring.process_request(self, request)


class SynapseRequest:
    """The parts of a Synapse request its authenticator reads."""

    def __init__(self, method: bytes, uri: bytes, authorization: list[bytes]) -> None:
        self.method = method
        self.uri = uri
        self.requestHeaders = Headers({b"Authorization": authorization})
        self.requester: str | None = None


class SynflowServer:
    """synflow.test's federation listener: the real gate, /send and key endpoint on StubTreq."""

    def __init__(self, fetch_keys: Any) -> None:
        self.clock = Clock()
        self.clock.advance(NOW_S)
        self.signing_key = generate_signing_key("a_1")
        self.receiver = Receiver(allowed_origins=[SYNAPSE])
        gate = FederationAuthResource(SYNFLOW, KeyRing(fetch_keys, self.clock),
                                      {SEND: self.receiver.handler.resource(origin_of=require_origin)})
        root = PrefixRoot()
        root.mount(FEDERATION_PREFIX, gate)
        root.mount(KEY_PATH, ServerKeyResource(SYNFLOW, self.signing_key, self.clock))
        self.stub = StubTreq(root)

    def served_key_response(self, testcase: SynchronousTestCase) -> Any:
        response = testcase.successResultOf(self.stub.get("http://synflow.test" + KEY_PATH))
        return json.loads(testcase.successResultOf(response.content()))


def _run(coroutine: Any) -> Deferred[Any]:
    return Deferred.fromCoroutine(coroutine)


class SynapseSignsSynflowVerifies(SynchronousTestCase):
    def setUp(self):
        self.synapse = SynapseServer(generate_signing_key("a_synapse"))
        key_response = SYNAPSE_LOCAL_KEY.LocalKey.response_json_object(self.synapse)
        self.synflow = SynflowServer(lambda server: succeed(key_response))

    def put(self, uri: str, content: Any, headers: list[bytes]) -> tuple[int, Any]:
        d = self.synflow.stub.put("http://synflow.test" + uri, data=json.dumps(content).encode(),
                                  headers={b"Authorization": headers, b"Content-Type": [b"application/json"]})
        response = self.successResultOf(d)
        return response.code, json.loads(self.successResultOf(response.content()))

    def test_synapse_signed_send_is_accepted(self):
        """A /send signed by Synapse's build_auth_headers, with Synapse's key response, is accepted by synflow."""
        uri = SEND + "/synapse-txn-1"
        content = {"origin": SYNAPSE, "origin_server_ts": 1, "pdus": [{
            "event_id": "$e1", "room_id": "!r:synflow.test", "type": "m.room.message", "sender": "@u:synapse.test",
            "content": {"body": "hi ☃"}, "origin_server_ts": 1}]}
        headers = SYNAPSE_CLIENT.MatrixFederationHttpClient.build_auth_headers(
            self.synapse, SYNFLOW.encode(), b"PUT", uri.encode(), content)
        self.assertEqual(self.put(uri, content, headers), (200, {"pdus": {"$e1": {}}}))
        self.assertEqual(self.synflow.receiver.persisted, [(SYNAPSE, "$e1")])

    def test_synapse_signature_for_another_server_is_refused(self):
        """A Synapse-signed request for another destination, replayed to synflow, gets 401."""
        uri = SEND + "/synapse-txn-2"
        content = {"origin": SYNAPSE, "origin_server_ts": 1, "pdus": []}
        headers = SYNAPSE_CLIENT.MatrixFederationHttpClient.build_auth_headers(
            self.synapse, b"elsewhere.test", b"PUT", uri.encode(), content)
        code, reply = self.put(uri, content, headers)
        self.assertEqual((code, reply["errcode"]), (401, "M_UNAUTHORIZED"))
        self.assertEqual(self.synflow.receiver.persisted, [])


class SynflowSignsSynapseVerifies(SynchronousTestCase):
    def setUp(self):
        self.synflow = SynflowServer(lambda server: succeed({}))
        served = self.synflow.served_key_response(self)
        self.synapse = SynapseServer(generate_signing_key("a_synapse"), served)
        self.uri = SEND + "/synflow-txn-1"
        self.content = {"origin": SYNFLOW, "origin_server_ts": 1, "pdus": []}

    def authenticate(self, header: bytes, content: Any) -> Deferred[Any]:
        request = SynapseRequest(b"PUT", self.uri.encode(), [header])
        return _run(SYNAPSE_SERVER.Authenticator.authenticate_request(self.synapse, request, content))

    def test_synflow_key_response_verifies_with_synapse(self):
        """Synapse's key-response check accepts the self-signed body synflow's key endpoint serves."""
        served = self.synflow.served_key_response(self)
        fetcher = _Namespace(store=NullStore())
        keys = self.successResultOf(_run(SYNAPSE_KEYRING.BaseV2KeyFetcher.process_v2_response(
            fetcher, SYNFLOW, served, NOW_S * 1000)))
        self.assertEqual(list(keys), ["ed25519:a_1"])
        self.assertEqual(keys["ed25519:a_1"].verify_key.encode(), self.synflow.signing_key.verify_key.encode())

    def test_synflow_signed_request_verifies_with_synapse(self):
        """Synapse's authenticator parses synflow's X-Matrix header and verifies its signature."""
        header = auth_header(SYNFLOW, SYNAPSE, self.synflow.signing_key, "PUT", self.uri, self.content)
        self.assertEqual(SYNAPSE_SERVER._parse_auth_header(header)[0::3], (SYNFLOW, SYNAPSE))
        self.assertEqual(self.successResultOf(self.authenticate(header, self.content)), SYNFLOW)

    def test_tampered_synflow_request_is_refused_by_synapse(self):
        """Synapse refuses synflow's signature over other content, or for another destination."""
        errors = SYNAPSE_ERRORS.SynapseError
        header = auth_header(SYNFLOW, SYNAPSE, self.synflow.signing_key, "PUT", self.uri, self.content)
        error = self.failureResultOf(self.authenticate(header, {**self.content, "pdus": [{}]}), errors).value
        self.assertEqual((error.code, error.errcode), (401, "M_UNAUTHORIZED"))
        self.assertIn("Invalid signature", error.msg)
        elsewhere = auth_header(SYNFLOW, "elsewhere.test", self.synflow.signing_key, "PUT", self.uri, self.content)
        error = self.failureResultOf(self.authenticate(elsewhere, self.content), errors).value
        self.assertEqual((error.code, error.errcode), (401, "M_UNAUTHORIZED"))
