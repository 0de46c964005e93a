"""Federation requests over HTTP with treq: ``/send`` and ``get_missing_events``.

:class:`TreqFederationTransport` implements
:class:`~synflow.federation.interfaces.FederationTransport`: it ``PUT``\\ s the
transaction's JSON to ``{base_url}/_matrix/federation/v1/send/{txnId}``; and
:class:`~synflow.federation.interfaces.MissingEventsTransport`: it ``POST``\\ s
to ``{base_url}/_matrix/federation/v1/get_missing_events/{roomId}``. Both go
through one request path, which adds the ``auth_headers`` (the request
signature) to every request, bounds the whole exchange (connect, request, reply) with a timeout on the
injected clock, and turns everything that is not a 2xx JSON object into a
:class:`~synflow.federation.interfaces.TransactionFailed`:

============================================  ===========
what happened                                 retriable
============================================  ===========
connection refused/reset, DNS, TLS errors     yes
no complete reply within the timeout          yes
5xx, 408, 429                                 yes
2xx whose body is not a JSON object           yes
reply body larger than ``max_response_bytes`` yes
any other status (3xx, 4xx)                   no
============================================  ===========

Every request is signed (``Authorization: X-Matrix``, see
:mod:`synflow.federation.signing`) when the transport is given this server's
signing key, except the unauthenticated key fetch (:meth:`get_server_keys`).
A destination listed in ``federation.destinations`` is reached through the
plain client; any other one through the guarded client, whose resolver drops
``federation.ip_range_blacklist`` addresses before connecting
(:mod:`synflow.federation.addresses`).

The client is anything treq-like with a ``request`` method (``treq`` itself, a
:class:`treq.client.HTTPClient`, or :class:`treq.testing.StubTreq` in tests).
:func:`build_treq_client` makes one on a reactor: TLS is verified by
default (treq's default browser-like policy); ``verify_tls=False`` is for
test deployments with self-signed certificates only.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IOpenSSLClientConnectionCreator, IReactorTime
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer

from synflow.config import FederationConfig
from synflow.federation.addresses import DEFAULT_IP_RANGE_BLACKLIST, AddressPolicy, GuardedReactor
from synflow.federation.interfaces import JsonDict, TransactionFailed
from synflow.federation.signing import auth_header

logger = logging.getLogger(__name__)

#: The path of the ``/send`` endpoint, before the URL-quoted transaction ID.
SEND_PATH = "/_matrix/federation/v1/send/"
#: The path of ``get_missing_events``, before the URL-quoted room ID.
GET_MISSING_EVENTS_PATH = "/_matrix/federation/v1/get_missing_events/"
#: The path of a server's key endpoint.
SERVER_KEYS_PATH = "/_matrix/key/v2/server"
#: The largest reply body read (a ``/send`` reply is small).
DEFAULT_MAX_RESPONSE_BYTES = 1024 * 1024
#: The largest ``get_missing_events`` reply read: 50 events of up to 64 KiB each, and room to spare.
MAX_MISSING_EVENTS_RESPONSE_BYTES = 4 * 1024 * 1024
_RETRIABLE_CODES = frozenset({408, 429})

#: ``auth_headers(destination, method, path, body)`` -> extra request headers.
AuthHeaders = Callable[[str, str, str, JsonDict | None], Mapping[bytes, list[bytes]]]


def signer(server_name: str, signing_key: Any) -> AuthHeaders:
    """``auth_headers`` signing every request as ``server_name`` with ``signing_key``."""

    def auth_headers(destination: str, method: str, path: str, body: JsonDict | None) -> Mapping[bytes, list[bytes]]:
        return {b"Authorization": [auth_header(server_name, destination, signing_key, method, path, body)]}

    return auth_headers


class _ReplyTooLarge(Exception):
    pass


@implementer(IOpenSSLClientConnectionCreator)
class _NoVerifyCreator:
    """Creates client TLS connections that send SNI but verify nothing."""

    def __init__(self, hostname: bytes) -> None:
        from twisted.internet.ssl import CertificateOptions

        self._hostname = hostname
        self._context = CertificateOptions(verify=False).getContext()

    def clientConnectionForTLS(self, tlsProtocol: Any) -> Any:
        from OpenSSL import SSL

        connection = SSL.Connection(self._context, None)
        connection.set_app_data(tlsProtocol)
        if not _is_ip_literal(self._hostname):
            connection.set_tlsext_host_name(self._hostname)
        connection.set_connect_state()
        return connection


@implementer(IPolicyForHTTPS)
class NoVerifyPolicy:
    """TLS without certificate verification: for test deployments only."""

    def creatorForNetloc(self, hostname: bytes, port: int) -> _NoVerifyCreator:
        return _NoVerifyCreator(hostname)


def _is_ip_literal(host: bytes) -> bool:
    try:
        ipaddress.ip_address(host.decode("ascii"))
    except ValueError:
        return False
    return True


def build_treq_client(reactor: Any, *, verify_tls: bool = True, persistent: bool = True,
                      address_policy: AddressPolicy | None = None) -> Any:
    """A :class:`treq.client.HTTPClient` on ``reactor``.

    Args:
        reactor: the reactor (needs TCP, and SSL for https).
        verify_tls: verify certificates (treq's default policy); False only
            for test setups with self-signed certificates.
        persistent: keep connections open between transactions.
        address_policy: if given, names resolve through it: addresses it
            blocks are never connected to.
    """
    from treq.client import HTTPClient

    if address_policy is not None:
        reactor = GuardedReactor(reactor, address_policy)
    pool = HTTPConnectionPool(reactor, persistent=persistent)
    if verify_tls:
        agent = Agent(reactor, pool=pool)
    else:
        agent = Agent(reactor, contextFactory=NoVerifyPolicy(), pool=pool)
    return HTTPClient(agent)


class TreqFederationTransport:
    """``/send`` over treq.

    Args:
        treq_client: a treq-like client (``request(method, url, data=..., headers=...)``
            returning a Deferred response with ``code`` and ``collect``).
        destinations: server name -> base URL overrides (``federation.destinations``).
        clock: runs the timeout.
        timeout_s: the bound on one whole exchange.
        max_response_bytes: the largest reply body accepted.
        auth_headers: optionally ``auth_headers(destination, method, path,
            body)`` returns extra headers for every request (for example a
            signed ``Authorization: X-Matrix ...``).
        server_name: our server name; without ``auth_headers``, requests
            carry an unsigned ``Authorization: X-Matrix
            origin=...,destination=...`` (refused by a synflow or Synapse
            receiver: for tests of the receiving side's other checks).
        guarded_client: the client for destinations not listed in
            ``destinations`` (one built with an address policy); None: the
            same client for all.
    """

    def __init__(
        self,
        treq_client: Any,
        destinations: Mapping[str, str],
        clock: IReactorTime,
        timeout_s: float = 30.0,
        *,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        auth_headers: AuthHeaders | None = None,
        server_name: str | None = None,
        guarded_client: Any = None,
    ) -> None:
        self._client = treq_client
        self._guarded_client = guarded_client if guarded_client is not None else treq_client
        self._server_name = server_name
        self._auth_headers = auth_headers
        self._destinations = dict(destinations)
        self._clock = clock
        self._timeout_s = timeout_s
        self._max_response_bytes = max_response_bytes

    @classmethod
    def from_config(cls, reactor: Any, config: FederationConfig, *, server_name: str | None = None,
                    signing_key: Any = None) -> TreqFederationTransport:
        """A transport on ``reactor`` configured by the ``federation`` section, asking as ``server_name``.

        With ``signing_key`` too, every request but the key fetch is signed.
        Destinations not listed in ``federation.destinations`` go through a
        client guarded by ``federation.ip_range_blacklist``.
        """
        client = build_treq_client(reactor, verify_tls=config.verify_tls)
        blacklist = config.ip_range_blacklist
        policy = AddressPolicy(DEFAULT_IP_RANGE_BLACKLIST if blacklist is None else blacklist)
        guarded = build_treq_client(reactor, verify_tls=config.verify_tls, address_policy=policy)
        auth = signer(server_name, signing_key) if server_name is not None and signing_key is not None else None
        return cls(client, config.destinations, reactor, config.request_timeout_s, auth_headers=auth,
                   server_name=server_name, guarded_client=guarded)

    def base_url(self, destination: str) -> str:
        """The base URL of ``destination``: the configured one, else ``https://<server_name>``."""
        return self._destinations.get(destination, f"https://{destination}").rstrip("/")

    def send_url(self, destination: str, txn_id: str) -> str:
        """The full ``/send`` URL of a transaction."""
        return self.base_url(destination) + SEND_PATH + quote(txn_id, safe="")

    def send_transaction(self, destination: str, txn_id: str, body: JsonDict) -> Deferred[JsonDict]:
        """Send one transaction; see the module docstring for the outcomes."""
        return self.request_json(destination, "PUT", SEND_PATH + quote(txn_id, safe=""), body, label=txn_id)

    def get_server_keys(self, destination: str) -> Deferred[JsonDict]:
        """``GET /_matrix/key/v2/server`` of ``destination`` (unsigned), as a JSON object.

        Fails with :class:`TransactionFailed` like :meth:`send_transaction`.
        """
        return self.request_json(destination, "GET", SERVER_KEYS_PATH, None, signed=False, label="server keys")

    def get_missing_events(self, destination: str, room_id: str, body: JsonDict) -> Deferred[JsonDict]:
        """``POST get_missing_events/{room_id}``; the outcomes are those of ``/send``."""
        return self.request_json(destination, "POST", GET_MISSING_EVENTS_PATH + quote(room_id, safe=""), body,
                                 label=f"get_missing_events {room_id}",
                                 max_response_bytes=MAX_MISSING_EVENTS_RESPONSE_BYTES)

    def request_json(self, destination: str, method: str, path: str, body: JsonDict | None, *, label: str = "",
                     max_response_bytes: int | None = None, signed: bool = True) -> Deferred[JsonDict]:
        """One federation request whose reply is a JSON object (every request goes through here).

        Args:
            destination: the server name (mapped through ``destinations``).
            method: ``GET``, ``PUT`` or ``POST``.
            path: the request path, exactly as sent (and signed).
            body: the JSON body, or None for a request without one.
            label: names the request in logs.
            max_response_bytes: the largest reply read (default: the transport's).
            signed: add the ``auth_headers`` (False only for the key fetch).
        """
        max_bytes = max_response_bytes if max_response_bytes is not None else self._max_response_bytes
        what = label or path
        url = self.base_url(destination) + path
        headers = {b"Content-Type": [b"application/json"]}
        if not signed:
            pass
        elif self._auth_headers is not None:
            headers.update(self._auth_headers(destination, method, path, body))
        elif self._server_name is not None:
            headers[b"Authorization"] = [f"X-Matrix origin={self._server_name},destination={destination}".encode()]
        client = self._client if destination in self._destinations else self._guarded_client
        d = Deferred.fromCoroutine(self._send(client, method, url, body, headers, max_bytes))
        # Not Deferred.addTimeout: the agent turns the cancellation into
        # ResponseNeverReceived, so remember that the timeout fired instead.
        timed_out: list[bool] = []

        def _expire() -> None:
            timed_out.append(True)
            d.cancel()

        call = self._clock.callLater(self._timeout_s, _expire)

        def _settled(result: Any) -> Any:
            if call.active():
                call.cancel()
            return result

        d.addBoth(_settled)
        return d.addErrback(self._classify, destination, what, timed_out)

    async def _send(self, client: Any, method: str, url: str, body: JsonDict | None,
                    headers: dict[bytes, list[bytes]], max_bytes: int) -> JsonDict:
        if body is None:
            response = await client.request(method, url, headers=headers)
        else:
            data = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
            response = await client.request(method, url, data=data, headers=headers)
        raw = await self._read(response, max_bytes)
        code = response.code
        if 200 <= code < 300:
            try:
                reply = json.loads(raw.decode("utf-8"))
            except ValueError as e:
                raise TransactionFailed(f"{code} reply is not JSON: {e}") from None
            if not isinstance(reply, dict):
                raise TransactionFailed(f"{code} reply is {type(reply).__name__}, not a JSON object")
            return reply
        retriable = code >= 500 or code in _RETRIABLE_CODES
        raise TransactionFailed(f"HTTP {code}: {_snippet(raw)}", retriable=retriable)

    async def _read(self, response: Any, max_bytes: int) -> bytes:
        chunks: list[bytes] = []
        size = 0

        def collect(chunk: bytes) -> None:
            nonlocal size
            size += len(chunk)
            if size > max_bytes:
                raise _ReplyTooLarge()
            chunks.append(chunk)

        try:
            await response.collect(collect)
        except _ReplyTooLarge:
            raise TransactionFailed(f"reply is larger than {max_bytes} bytes") from None
        return b"".join(chunks)

    def _classify(self, failure: Failure, destination: str, what: str, timed_out: list[bool]) -> Failure:
        if timed_out:
            return Failure(TransactionFailed(f"no reply within {self._timeout_s}s"))
        if failure.check(TransactionFailed):
            return failure
        if failure.check(defer.CancelledError):
            return failure
        logger.debug("sending %s to %s failed: %s", what, destination, failure.getTraceback())
        exc = failure.value
        return Failure(TransactionFailed(f"{type(exc).__name__}: {exc}"))


def _snippet(raw: bytes, limit: int = 200) -> str:
    text = raw[:limit].decode("utf-8", "replace")
    return text + ("..." if len(raw) > limit else "")
